"""The suite's llama.cpp option, without a long load: kvgate's config in front of
llama-server, the simulator fitted to a probe, the calibration with slots, the CLI, and
the client that ends each answer itself (fake backends on 127.0.0.1, a few requests)."""

from __future__ import annotations

import asyncio
import tomllib
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from benchmarks.run import LLAMA, VLLM, llama_plan, parse_args, rate_for, vllm_plan
from benchmarks.suite.cluster import GateSettings, SimParams, Target, to_toml
from benchmarks.suite.llamacpp import (
    LLAMA_BODY,
    LLAMA_MODEL,
    LlamaParams,
    Probe,
    kvgate_llama_config,
    parse_llama_metrics,
)
from benchmarks.suite.loadgen import ENDED_EARLY, STREAM_ERROR, client_held, run_open_loop
from benchmarks.suite.report import completed, is_engine_failure, outcome_split
from benchmarks.suite.workloads import Behaviour, PromptBuilder, RequestSpec
from proxy.config import parse_config
from proxy.modelconfig import ConfigError
from proxy.tokenize import load_counter
from tests.support.servers import fake_backend

ROOT = Path(__file__).resolve().parent.parent
QWEN = ROOT / "models" / "qwen3-14b"
SERVERS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def test_kvgate_config_in_front_of_llama_server(tmp_path: Path) -> None:
    params = LlamaParams(ctx_size=4096, parallel=4)
    config = kvgate_llama_config(params, GateSettings(reservation=Target.STRICT.reservation),
                                 port=9, servers=SERVERS, model_dir=QWEN)
    assert tomllib.loads(to_toml(config)) == config
    parsed = parse_config(tomllib.loads(to_toml(config)), base=tmp_path)
    model = parsed.models[0]
    assert model.name == LLAMA_MODEL == LLAMA_BODY["model"]
    assert (model.max_model_len, model.capacity_tokens, model.block_size) == (4096, 4096, 1)
    assert model.reservation.value == "strict" and model.prefix_sharing.value == "off"
    assert [(b.url, b.kind.value, b.slots) for b in model.backends] == [
        (u, "llama.cpp", 4) for u in SERVERS]
    # the `adaptive` target is written as for the simulator; kvgate refuses it here
    adaptive = kvgate_llama_config(params, GateSettings(reservation="adaptive"), port=9,
                                   servers=SERVERS, model_dir=QWEN)
    with pytest.raises(ConfigError, match=r"adaptive.*unsafe with llama\.cpp"):
        parse_config(tomllib.loads(to_toml(adaptive)), base=tmp_path)


def test_probe_fits_the_simulator_and_slots_cap_the_calibration() -> None:
    probe = Probe(prompt_tokens=975, output_tokens=160, step_ms={1: 3.0, 3: 5.8},
                  prefill_tokens_per_s=24000.0, wall_s=3.0)
    sim = probe.sim_params(LlamaParams(ctx_size=4096, parallel=4))
    assert (sim.kv_tokens, sim.max_model_len, sim.max_num_seqs) == (4096, 4096, 4)
    assert sim.per_seq_ms == pytest.approx(1.4) and sim.decode_step_ms == pytest.approx(1.6)
    assert sim.prefill_tokens_per_s == 24000 and not sim.prefix_caching
    # short requests: the pool would hold 20 each, 4 slots run; 1x follows the slots
    specs = [RequestSpec(arrival_s=0, prompt_tokens=150, output_tokens=50)] * 4
    free = SimParams(kv_tokens=4096, decode_step_ms=1.6, per_seq_ms=1.4)
    slotted = SimParams(kv_tokens=4096, decode_step_ms=1.6, per_seq_ms=1.4, max_num_seqs=4)
    assert rate_for(1.0, specs, slotted) == pytest.approx(2 * 4 / (50 * slotted.step_s(4)))
    assert rate_for(1.0, specs, slotted) < rate_for(1.0, specs, free)  # 20 run there


def test_cli_engine_option_and_its_scenarios() -> None:
    args = parse_args(["--engine", "llama.cpp", "--scenarios", "S2",
                       "--behaviours", "cap-2048,none"])
    assert args.engine == "llama.cpp" and not args.no_sim_twin
    assert parse_args([]).engine == "sim"
    assert parse_args(["--engine", "vllm"]).engine == "vllm"
    with pytest.raises(SystemExit):
        parse_args(["--engine", "sglang"])
    sim = SimParams(kv_tokens=LLAMA.ctx_size, decode_step_ms=1.6, per_seq_ms=1.4,
                    max_model_len=LLAMA.max_model_len, max_num_seqs=LLAMA.parallel)
    [s2], header = llama_plan(20.0, {"S2"}, LLAMA, sim)
    assert s2.key == "S2" and s2.specs
    assert max(s.prompt_tokens for s in s2.specs) <= 2000
    assert max(s.prompt_tokens + s.output_tokens for s in s2.specs) <= LLAMA.ctx_size
    assert header.startswith("The simulator twin's pool: 2 simulated backends x 4,096")
    with pytest.raises(SystemExit):
        llama_plan(20.0, {"S3"}, LLAMA, sim)


def test_parse_llama_metrics() -> None:
    text = ("# HELP llamacpp:requests_processing Number of requests processing\n"
            "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 3\n"
            "llamacpp:requests_deferred 2\nllamacpp:tokens_predicted_total 1234\n")
    assert parse_llama_metrics(text) == {"llamacpp:requests_processing": 3.0,
                                         "llamacpp:requests_deferred": 2.0,
                                         "llamacpp:tokens_predicted_total": 1234.0}


def test_client_ends_each_answer_and_no_body_carries_its_length() -> None:
    """A backend that streams until told to stop (as the random-weight model does): the
    client hangs up at the recorded length; bodies carry max_tokens as the behaviour says
    and never the length. An error event mid-stream and an answer that ends short are
    engine failures."""
    seen: list[dict[str, Any]] = []
    held: list[int] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = len(body["messages"][0]["content"]) // 4  # the prompt's words pick the case
        try:
            for i in range(400):  # bounded: 400 chunks at most
                if n % 3 == 1 and i == 5:
                    await resp.write(b'data: {"error":{"code":500,"message":"Context size '
                                     b'has been exceeded.","type":"server_error"}}\n\n')
                    return resp
                if n % 3 == 2 and i == 5:
                    break  # ends short, without an error
                await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n')
                await asyncio.sleep(0.002)
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return resp

    builder = PromptBuilder(load_counter(QWEN))
    # six consecutive prompt lengths: the backend's case (n % 3) follows the word count
    specs = [RequestSpec(arrival_s=0.01 * i, prompt_tokens=p, output_tokens=20 + i)
             for i, p in enumerate(range(40, 46))]

    async def scenario() -> list[Any]:
        async with fake_backend(chat) as base:
            runs = []
            for behaviour in (Behaviour.CAP_2048, Behaviour.NONE):
                run = await run_open_loop(
                    [base], specs, builder, hard_stop_s=10, behaviour=behaviour,
                    hang_up_at_output=True, sim_fields=False, body_extra=LLAMA_BODY,
                    fresh_connections=True,
                    watch=lambda rs: held.append(client_held(rs)))
                runs.append(run)
            return runs

    runs = asyncio.run(scenario())
    assert held == [0, 0]  # handed the results before the first request
    assert len(seen) == 12
    assert all("sim_output_tokens" not in b and b["cache_prompt"] is False
               and b["temperature"] == 0 and b["model"] == LLAMA_MODEL for b in seen)
    assert [b.get("max_tokens") for b in seen] == [2048] * 6 + [None] * 6
    for run in runs:
        for r in run.results:
            n = len(builder.body(r.spec, behaviour=Behaviour.NONE)["messages"][0]["content"]) \
                // 4
            if n % 3 == 0:
                assert completed(r) and r.hung_up and r.tokens_out == r.spec.output_tokens
            elif n % 3 == 1:
                assert r.code == STREAM_ERROR and not completed(r)
                assert b"Context size has been exceeded" in r.last_line
            else:
                assert r.code == ENDED_EARLY and r.tokens_out == 5
            assert r.code is None or is_engine_failure(r.code)
    assert outcome_split({"500": 2, STREAM_ERROR: 1, ENDED_EARLY: 1,
                          "client_error:ServerDisconnectedError": 1, "queue_timeout": 3,
                          "abandoned": 1, "cut_at_benchmark_end": 2}) == (5, 3, 3)


def test_bench_peers_config_in_front_of_llama_server(tmp_path: Path) -> None:
    """`bench_peers --engine llama.cpp`: kvgate in front of one llama-server is a valid
    config (kind llama.cpp, its slots, strict: adaptive is refused there) sized to it."""
    from benchmarks.bench_peers import LLAMA_CTX, LLAMA_SLOTS, kvgate_config
    from proxy.config import load_config

    config = load_config(kvgate_config(tmp_path, 9, "http://127.0.0.1:1",
                                       llama_slots=LLAMA_SLOTS))
    model = config.models[0]
    assert model.backends[0].kind.value == "llama.cpp"
    assert model.backends[0].slots == LLAMA_SLOTS
    assert model.reservation.value == "strict"
    assert model.capacity_tokens == model.max_model_len == LLAMA_CTX


# ------------------------------------------------------------------------- vLLM CPU


def test_kvgate_config_in_front_of_vllm(tmp_path: Path) -> None:
    """kvgate in front of the vLLM CPU servers: kind vllm, the usable pool (one block is
    vLLM's null block) as kv_tokens, its block size, prefix sharing off as the engines'
    caching is; strict and adaptive both valid (vLLM preempts)."""
    from benchmarks.suite.vllm import VLLM_BODY, VLLM_MODEL, kvgate_vllm_config

    assert VLLM.kv_tokens == (VLLM.num_blocks - 1) * VLLM.block_size == 4096
    for reservation in ("strict", "adaptive"):
        config = kvgate_vllm_config(VLLM, GateSettings(reservation=reservation), port=9,
                                    servers=SERVERS, model_dir=QWEN)
        assert tomllib.loads(to_toml(config)) == config
        model = parse_config(tomllib.loads(to_toml(config)), base=tmp_path).models[0]
        assert model.name == VLLM_MODEL == VLLM_BODY["model"]
        assert (model.max_model_len, model.capacity_tokens, model.block_size) == (
            2048, 4096, 32)
        assert model.reservation.value == reservation
        assert model.prefix_sharing.value == "off"
        assert [(b.url, b.kind.value) for b in model.backends] == [
            (u, "vllm") for u in SERVERS]
    # nothing that tells the engine or kvgate the answer's length
    assert set(VLLM_BODY) == {"model", "temperature"}


def test_vllm_plan_and_twin() -> None:
    """S1 / S2 clipped to a vLLM context; the twin takes the pool and max_num_seqs."""
    probe = Probe(prompt_tokens=792, output_tokens=160, step_ms={1: 20.0, 3: 22.0},
                  prefill_tokens_per_s=9000.0, wall_s=5.0)
    sim = probe.sim_params(VLLM)
    assert (sim.kv_tokens, sim.max_model_len, sim.max_num_seqs) == (4096, 2048, 16)
    assert sim.per_seq_ms == pytest.approx(1.0) and sim.decode_step_ms == pytest.approx(19.0)
    [s1, s2], header = vllm_plan(20.0, {"S1", "S2"}, sim)
    assert len(s2.specs) > len(s1.specs) > 0
    assert max(s.prompt_tokens + s.output_tokens for s in s2.specs) <= VLLM.max_model_len
    assert header.startswith("The simulator twin's pool: 2 simulated backends x 4,096")
    with pytest.raises(SystemExit):
        vllm_plan(20.0, {"G"}, sim)


def test_client_takes_the_models_own_end_as_completed() -> None:
    """vLLM's random weights end an answer now and then: with `model_may_end` an answer
    ended `stop` before its recorded length is completed (`model_ended`), one that ends
    without a finish_reason is still `ended_early`, and the rest are hung up on."""
    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = len(body["messages"][0]["content"]) // 4
        try:
            for i in range(400):  # bounded
                if i == 5 and n % 3 == 1:
                    await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"x"},'
                                     b'"finish_reason":"stop"}]}\n\n')
                    break
                if i == 5 and n % 3 == 2:
                    break
                await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"x"},'
                                 b'"finish_reason":null}]}\n\n')
                await asyncio.sleep(0.002)
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return resp

    builder = PromptBuilder(load_counter(QWEN))
    specs = [RequestSpec(arrival_s=0.01 * i, prompt_tokens=p, output_tokens=20)
             for i, p in enumerate(range(40, 46))]

    async def scenario() -> list[Any]:
        async with fake_backend(chat) as base:
            run = await run_open_loop([base], specs, builder, hard_stop_s=10,
                                      behaviour=Behaviour.NONE, hang_up_at_output=True,
                                      sim_fields=False, model_may_end=True)
            return run.results

    for r in asyncio.run(scenario()):
        n = len(builder.body(r.spec, behaviour=Behaviour.NONE)["messages"][0]["content"]) // 4
        if n % 3 == 0:
            assert completed(r) and r.hung_up and not r.model_ended and r.tokens_out == 20
        elif n % 3 == 1:
            assert completed(r) and r.model_ended and r.tokens_out == 6 and r.finish == "stop"
        else:
            assert r.code == ENDED_EARLY and not completed(r)


def test_bench_peers_config_in_front_of_vllm(tmp_path: Path) -> None:
    """`bench_peers --engine vllm`: kvgate in front of one vLLM server, kind vllm,
    adaptive, its served name and pool."""
    from benchmarks.bench_peers import VLLM_BLOCK, VLLM_BLOCKS, VLLM_NAME, kvgate_config
    from proxy.config import load_config

    config = load_config(kvgate_config(tmp_path, 9, "http://127.0.0.1:1", vllm_dir=QWEN))
    model = config.models[0]
    assert model.name == VLLM_NAME
    assert model.backends[0].kind.value == "vllm"
    assert model.reservation.value == "adaptive"
    assert model.capacity_tokens == (VLLM_BLOCKS - 1) * VLLM_BLOCK
    assert model.block_size == VLLM_BLOCK
