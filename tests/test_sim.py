"""The simulated GPU backend over real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.sim.engine import EngineConfig, OutputLength, SimEngine
from tests.support.metrics import samples
from tests.support.reference import hf_count, hf_tokenizer
from tests.support.servers import running_sim
from tests.support.tasks import stop

MODELS = Path(__file__).resolve().parent.parent / "models"


def chat_body(content: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": content}], **extra}


async def state(session: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    async with session.get(f"{base}/sim/state") as resp:
        data: dict[str, Any] = await resp.json()
        return data


async def read_sse(resp: aiohttp.ClientResponse) -> list[Any]:
    events: list[Any] = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            payload = line[6:]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_sim_finish_reason_and_usage_exact_with_real_tokenizer() -> None:
    async def scenario() -> None:
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        # transformers, not the counter the simulator itself uses
        expected_prompt = hf_count(hf_tokenizer(MODELS / "qwen3-14b"), {"messages": msgs})
        assert expected_prompt == 15
        async with running_sim(kv_tokens=4096, output_length=OutputLength.MAX,
                               model="qwen3", model_dir=str(MODELS / "qwen3-14b")) as base, \
                aiohttp.ClientSession() as s:
            body = {"model": "qwen3", "messages": msgs, "max_tokens": 7}
            async with s.post(f"{base}/v1/chat/completions", json=body) as resp:
                data = await resp.json()
            assert data["choices"][0]["finish_reason"] == "length"
            # 15 prompt tokens: under one block of 16, so nothing to find cached
            assert data["usage"] == {"prompt_tokens": expected_prompt, "completion_tokens": 7,
                                     "total_tokens": expected_prompt + 7,
                                     "prompt_tokens_details": {"cached_tokens": 0}}
            body = {**body, "stream": True, "stream_options": {"include_usage": True}}
            async with s.post(f"{base}/v1/chat/completions", json=body) as resp:
                events = await read_sse(resp)
            assert events[-1] == "[DONE]"
            content = [e["choices"][0]["delta"].get("content") for e in events[1:-1]
                       if e["choices"] and e["choices"][0]["delta"].get("content")]
            assert len(content) == 7
            assert events[-3]["choices"][0]["finish_reason"] == "length"
            assert events[-2]["usage"]["completion_tokens"] == 7

    asyncio.run(scenario())


def test_sim_lognormal_lengths_stop_before_max_and_are_seeded() -> None:
    async def lengths(seed: int) -> list[tuple[str, int]]:
        async with running_sim(kv_tokens=100_000, seed=seed) as base, \
                aiohttp.ClientSession() as s:
            out = []
            for _ in range(12):
                async with s.post(f"{base}/v1/chat/completions",
                                  json=chat_body(max_tokens=400)) as resp:
                    data = await resp.json()
                choice = data["choices"][0]
                out.append((choice["finish_reason"], data["usage"]["completion_tokens"]))
            return out

    first = asyncio.run(lengths(3))
    assert first == asyncio.run(lengths(3))
    assert any(reason == "stop" and n < 400 for reason, n in first)
    for reason, n in first:
        assert (reason == "length") == (n == 400)


def test_sim_n_choices_and_completions_default_16() -> None:
    async def scenario() -> None:
        async with running_sim(kv_tokens=4096, output_length=OutputLength.MAX) as base, \
                aiohttp.ClientSession() as s:
            async with s.post(f"{base}/v1/chat/completions",
                              json=chat_body(max_tokens=5, n=3)) as resp:
                data = await resp.json()
            assert sorted(c["index"] for c in data["choices"]) == [0, 1, 2]
            assert data["usage"]["completion_tokens"] == 15
            async with s.post(f"{base}/v1/completions",
                              json={"model": "sim-model", "prompt": [1, 2, 3]}) as resp:
                data = await resp.json()
            assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 16,
                                     "total_tokens": 19,
                                     "prompt_tokens_details": {"cached_tokens": 0}}

    asyncio.run(scenario())


def test_sim_request_larger_than_pool_is_an_error_not_a_hang() -> None:
    async def scenario() -> None:
        async with running_sim(kv_tokens=256) as base, aiohttp.ClientSession() as s:
            async with asyncio.timeout(5), s.post(
                f"{base}/v1/chat/completions", json=chat_body(max_tokens=1000)
            ) as resp:
                assert resp.status == 400
                data = await resp.json()
            assert "can never fit the KV cache of 256 tokens" in data["error"]["message"]

    asyncio.run(scenario())


async def _burst(base: str, count: int, max_tokens: int) -> tuple[float, dict[str, Any]]:
    async with aiohttp.ClientSession() as s:
        peak = 0

        async def one() -> float:
            t0 = time.perf_counter()
            async with s.post(f"{base}/v1/chat/completions",
                              json=chat_body("x" * 400, max_tokens=max_tokens)) as resp:
                data = await resp.json()
            assert data["choices"][0]["finish_reason"] == "length"
            return time.perf_counter() - t0

        async def sample() -> None:
            nonlocal peak
            while True:
                st = await state(s, base)
                peak = max(peak, st["blocks_used"])
                assert st["blocks_used"] <= st["num_blocks"]
                await asyncio.sleep(0.005)

        sampler = asyncio.create_task(sample())
        async with asyncio.timeout(60):
            latencies = await asyncio.gather(*(one() for _ in range(count)))
        await stop(sampler)
        final = await state(s, base)
        final["sampled_peak"] = peak
        return max(latencies), final


def test_sim_overload_preempts_and_slows_under_pool_does_not() -> None:
    async def scenario() -> None:
        cfg = {"kv_tokens": 1024, "output_length": OutputLength.MAX,
               "decode_step_ms": 1.0, "per_seq_ms": 0.05}
        async with running_sim(**cfg) as base:
            # 3 requests x (106 prompt + 100 out) = 618 tokens resident: under the pool
            calm_latency, calm = await _burst(base, 3, 100)
        async with running_sim(**cfg) as base:
            # 24 requests x 306 tokens = 7,344 resident demand: 7x the pool
            busy_latency, busy = await _burst(base, 24, 200)
        assert calm["preemptions"] == 0
        assert busy["preemptions"] > 0
        for st in (calm, busy):
            assert st["invariant_violations"] == 0
            assert st["peak_blocks_used"] <= st["num_blocks"] == 64
            assert st["blocks_used"] == 0
        assert busy_latency > 2 * calm_latency

    asyncio.run(scenario())


def test_sim_client_disconnect_frees_blocks() -> None:
    async def scenario() -> None:
        async with running_sim(kv_tokens=4096, output_length=OutputLength.MAX,
                               decode_step_ms=5) as base, aiohttp.ClientSession() as s:
            resp = await s.post(f"{base}/v1/chat/completions",
                                json=chat_body(max_tokens=2000, stream=True))
            await resp.content.readline()
            assert (await state(s, base))["blocks_used"] > 0
            resp.close()  # the client goes away mid-stream
            async with asyncio.timeout(5):
                while (st := await state(s, base))["blocks_used"] or st["running"]:
                    await asyncio.sleep(0.02)
            assert st["generation_tokens_total"] < 2000

    asyncio.run(scenario())


def test_sim_metrics_use_vllm_names_and_models_health() -> None:
    async def scenario() -> None:
        async with running_sim(kv_tokens=4096, block_size=16) as base, \
                aiohttp.ClientSession() as s:
            async with s.post(f"{base}/v1/chat/completions", json=chat_body(max_tokens=3)):
                pass
            async with s.get(f"{base}/metrics") as resp:
                text = await resp.text()
            got = samples(text)
            for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                         "vllm:num_requests_waiting", "vllm:num_preemptions_total"):
                assert got[name], name
            # one request: its prompt and its 3 generated tokens
            assert [v for _, v in got["vllm:generation_tokens_total"]] == [3.0]
            assert next(v for _, v in got["vllm:prompt_tokens_total"]) > 0
            # 256 blocks for requests, and the null block vLLM counts in
            assert 'vllm:cache_config_info{block_size="16",num_gpu_blocks="257"' in text
            async with s.get(f"{base}/v1/models") as resp:
                assert (await resp.json())["data"][0]["id"] == "sim-model"
            async with s.get(f"{base}/health") as resp:
                assert resp.status == 200
            async with s.post(f"{base}/v1/chat/completions", data=b"{bad") as resp:
                assert resp.status == 400

    asyncio.run(scenario())


def test_engine_preempts_newest_and_recomputes() -> None:
    async def scenario() -> None:
        engine = SimEngine(EngineConfig(kv_tokens=64, block_size=16,
                                        output_length=OutputLength.MAX))
        engine.start()
        q: asyncio.Queue[tuple[int, int | None]] = asyncio.Queue()
        a = engine.submit(prompt_tokens=16, max_tokens=32, out=q, index=0)
        b = engine.submit(prompt_tokens=16, max_tokens=32, out=q, index=1)
        done = 0
        async with asyncio.timeout(5):
            while done < 2:
                if (await q.get())[1] is None:
                    done += 1
        await engine.stop()
        # 4 blocks; each needs 3 at the end: b (newest) must have been preempted.
        assert a.preemptions == 0
        assert b.preemptions >= 1
        assert (a.generated, b.generated) == (32, 32)
        assert engine.blocks_used == 0
        assert engine.invariant_violations == 0

    asyncio.run(scenario())


def test_engine_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        EngineConfig(kv_tokens=8)
    with pytest.raises(ValueError, match="`decode_step_ms` must be >= 0"):
        EngineConfig(kv_tokens=64, decode_step_ms=-1)


async def _finish(s: aiohttp.ClientSession, base: str, endpoint: str, stream: bool,
                  **fields: Any) -> tuple[int, str | None, int]:
    """(status, finish_reason, completion tokens) for one request, counted from the wire."""
    if endpoint == "chat":
        url, body = f"{base}/v1/chat/completions", chat_body(**fields)
    else:
        url, body = f"{base}/v1/completions", {"model": "sim-model", "prompt": "hi", **fields}
    if stream:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with asyncio.timeout(20), s.post(url, json=body) as resp:
        if resp.status != 200:
            return resp.status, (await resp.json())["error"]["param"], 0
        if not stream:
            data = await resp.json()
            return 200, data["choices"][0]["finish_reason"], data["usage"]["completion_tokens"]
        events = await read_sse(resp)
    assert events[-1] == "[DONE]"
    pieces = 0
    reason = None
    for e in events[:-1]:
        for c in e["choices"]:
            text = c["delta"].get("content") if endpoint == "chat" else c["text"]
            pieces += bool(text)
            reason = c["finish_reason"] or reason
    assert events[-2]["usage"]["completion_tokens"] == pieces
    return 200, reason, pieces


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_sim_output_tokens_ignore_eos_and_min_tokens(endpoint: str, stream: bool) -> None:
    async def scenario() -> None:
        # lognormal lengths (median 64) unless the request says otherwise
        async with running_sim(kv_tokens=100_000, seed=1) as base, \
                aiohttp.ClientSession() as s:
            async def check(expected: tuple[str, int], **fields: Any) -> None:
                got = await _finish(s, base, endpoint, stream, **fields)
                assert got == (200, *expected), fields

            await check(("stop", 5), sim_output_tokens=5, max_tokens=20)
            await check(("stop", 20), sim_output_tokens=20, max_tokens=20)  # EOS wins a tie
            await check(("length", 20), sim_output_tokens=30, max_tokens=20)
            await check(("length", 20), sim_output_tokens=5, max_tokens=20, ignore_eos=True)
            await check(("stop", 9), sim_output_tokens=5, max_tokens=20, min_tokens=9)
            await check(("stop", 5), sim_output_tokens=5, max_tokens=20, min_tokens=0)
            await check(("stop", 7), sim_output_tokens=7)  # no max_tokens: EOS still ends it
            await check(("stop", 5), sim_output_tokens=5, ignore_eos=False)
            # without the field the seeded lognormal length applies; ignore_eos overrides it
            # and min_tokens = max_tokens makes every draw reach the end
            for _ in range(3):
                await check(("length", 300), max_tokens=300, ignore_eos=True)
                _, _, n = await _finish(s, base, endpoint, stream, max_tokens=300,
                                        min_tokens=300)
                assert n == 300
            if endpoint == "completions":  # vLLM's default of 16 caps an absent max_tokens
                await check(("length", 16), sim_output_tokens=40)

    asyncio.run(scenario())


@pytest.mark.parametrize(("fields", "param"), [
    ({"sim_output_tokens": "5"}, "sim_output_tokens"),
    ({"sim_output_tokens": 0}, "sim_output_tokens"),
    ({"sim_output_tokens": True}, "sim_output_tokens"),
    ({"sim_output_tokens": 2.5}, "sim_output_tokens"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": "3"}, "min_tokens"),
    ({"min_tokens": 30, "max_tokens": 20}, "min_tokens"),
])
def test_sim_stop_fields_are_type_checked(fields: dict[str, Any], param: str) -> None:
    async def scenario() -> None:
        async with running_sim(kv_tokens=4096) as base, aiohttp.ClientSession() as s:
            for endpoint in ("chat", "completions"):
                async with s.post(f"{base}/v1/{'chat/' if endpoint == 'chat' else ''}"
                                  "completions",
                                  json=(chat_body(**fields) if endpoint == "chat" else
                                        {"model": "sim-model", "prompt": "x", **fields})
                                  ) as resp:
                    assert resp.status == 400
                    error = (await resp.json())["error"]
                assert error["code"] == "invalid_request"
                assert error["param"] == param
                assert param in error["message"]
            assert (await state(s, base))["finished"] == 0

    asyncio.run(scenario())


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing")


def test_sim_metrics_report_usage_fraction_and_abort_a_waiting_request_on_disconnect() -> None:
    """A client that gives up before its first token frees its place in the engine."""
    async def scenario() -> None:
        # 16 blocks; each request needs 13 for its prompt (206 tokens): one runs, one waits
        # (without prefix caching: with it, the second's equal prompt shares 12 blocks)
        async with running_sim(kv_tokens=256, output_length=OutputLength.MAX,
                               decode_step_ms=30, prefix_caching=False) as base, \
                aiohttp.ClientSession() as s:
            body = chat_body("x" * 800, max_tokens=45, stream=True)
            first = await s.post(f"{base}/v1/chat/completions", json=body)
            await first.content.readline()
            # its headers come at once, its body (role chunk first) with its first token
            second = await s.post(f"{base}/v1/chat/completions", json=body)
            async with asyncio.timeout(5):
                while (await state(s, base))["waiting"] != 1:
                    await asyncio.sleep(0.01)
            async with s.get(f"{base}/metrics") as resp:
                text = await resp.text()
            assert 13 / 16 <= _metric(text, "vllm:kv_cache_usage_perc") <= 1.0
            assert _metric(text, "vllm:num_requests_running") == 1
            assert _metric(text, "vllm:num_requests_waiting") == 1
            assert _metric(text, "vllm:num_preemptions_total") == 0
            second.close()  # gives up before its first token
            async with asyncio.timeout(2):
                while (st := await state(s, base))["waiting"]:
                    await asyncio.sleep(0.01)
            assert st["running"] == 1  # the first one is still generating
            events = await read_sse(first)
            assert events[-1] == "[DONE]"
            st = await state(s, base)
            assert st["generation_tokens_total"] == 45  # the abandoned one never ran
            assert st["blocks_used"] == 0
            async with s.get(f"{base}/metrics") as resp:
                assert _metric(await resp.text(), "vllm:kv_cache_usage_perc") == 0.0

    asyncio.run(scenario())


def test_kvgate_forwards_stop_fields_unread() -> None:
    """Through kvgate the simulator still sees sim_output_tokens, ignore_eos and min_tokens,
    and kvgate's reservation ignores sim_output_tokens (prompt + max_tokens, or fill)."""
    from tests.support.stack import running_stack

    async def scenario() -> None:
        async with running_stack(backends=1, kv_tokens=16384) as stack, \
                aiohttp.ClientSession() as s:
            async def ask(**fields: Any) -> tuple[str, int, int, int]:
                body = {"model": "qwen3-14b",
                        "messages": [{"role": "user", "content": "hello"}], **fields}
                async with s.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    data = await resp.json()
                    reserved = int(resp.headers["x-kvgate-reserved-tokens"])
                    prompt = int(resp.headers["x-kvgate-prompt-tokens"])
                return (data["choices"][0]["finish_reason"],
                        data["usage"]["completion_tokens"], reserved - prompt, prompt)

            reason, n, reserved_out, _ = await ask(sim_output_tokens=5, max_tokens=50)
            assert (reason, n) == ("stop", 5)
            assert reserved_out >= 50  # the client's max_tokens, not the hidden length
            assert (await ask(sim_output_tokens=5, max_tokens=50, ignore_eos=True))[:2] == (
                "length", 50)
            assert (await ask(sim_output_tokens=5, max_tokens=50, min_tokens=9))[:2] == (
                "stop", 9)
            reason, n, reserved_out, prompt = await ask(sim_output_tokens=6)
            assert (reason, n) == ("stop", 6)
            assert reserved_out >= 8192 - prompt  # fill: max_model_len - prompt

    asyncio.run(scenario())


def test_an_assertion_in_a_stopped_background_check_reaches_the_test() -> None:
    async def scenario() -> None:
        async def check() -> None:
            raise AssertionError("over the pool")

        task = asyncio.create_task(check())
        await asyncio.sleep(0)
        with pytest.raises(AssertionError, match="over the pool"):
            await stop(task)
        idle = asyncio.create_task(asyncio.sleep(10))
        await stop(idle)  # a plain cancel is not a failure
        assert idle.cancelled()

    asyncio.run(scenario())


def test_sim_answers_health_probes_while_it_counts_a_large_body() -> None:
    """A 3 MB prompt is counted in a thread: the server's loop keeps answering (kvgate's
    health probes, other streams) meanwhile, as an engine's serving loop does. Counted
    inline, it answered nothing for the seconds the count took."""

    async def scenario() -> None:
        async with running_sim(kv_tokens=65536, output_length=OutputLength.MAX,
                               max_model_len=131072, model="qwen3",
                               model_dir=str(MODELS / "qwen3-14b")) as base, \
                aiohttp.ClientSession() as s:
            body = {"model": "qwen3", "max_tokens": 1,
                    "messages": [{"role": "user", "content": " " * 3_000_000 + "x"}]}
            answered_during = 0
            done = asyncio.Event()

            async def probe() -> None:
                nonlocal answered_during
                while not done.is_set():
                    async with s.get(f"{base}/health") as resp:
                        assert resp.status == 200
                    if not done.is_set():
                        answered_during += 1
                    await asyncio.sleep(0.01)

            async def big() -> dict[str, Any]:
                try:
                    async with s.post(f"{base}/v1/chat/completions", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                        data: dict[str, Any] = await resp.json()
                        return data
                finally:
                    done.set()

            prober = asyncio.create_task(probe())
            async with asyncio.timeout(120):
                data = await big()
            await stop(prober)
            assert data["usage"]["prompt_tokens"] > 1_000
            assert answered_during >= 5

    asyncio.run(scenario())
