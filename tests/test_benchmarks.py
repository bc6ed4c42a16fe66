"""The benchmark suite's parts: exact prompts, client behaviours, calibrated loads, the
client-side give-up, the summary's definitions, and a tiny real run end to end."""

from __future__ import annotations

import asyncio
import math
import statistics
import subprocess
import sys
import tomllib
from dataclasses import replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from benchmarks.run import _foreknowledge_bound, parse_args, rate_for, rate_for_shared
from benchmarks.suite.cluster import (
    AFFINITY_CHARS,
    AffinityRing,
    GateSettings,
    SimParams,
    Target,
    kvgate_config,
    to_toml,
)
from benchmarks.suite.engine_run import Limits, end_state_note, run_target
from benchmarks.suite.loadgen import ABANDONED, CUT, Result, Run, Sample, run_open_loop
from benchmarks.suite.refusals import acceptance, refusal_table, summarize_refusals
from benchmarks.suite.report import AWARE, ONE_ENGINE, prefix_summary, summarize
from benchmarks.suite.report import acceptance as acceptance_of_prefix
from benchmarks.suite.workloads import (
    Behaviour,
    PromptBuilder,
    RequestSpec,
    bursty_long_prompts,
    group_prompts,
    hol_mix,
    load_azure,
    load_mooncake,
    mooncake_conversations,
    replay,
    synthetic_mix,
)
from proxy.config import parse_config
from proxy.sim.engine import OutputLength
from proxy.tokenize import ChatRequest, load_counter
from tests.support.servers import fake_backend, running_sim

ROOT = Path(__file__).resolve().parent.parent
QWEN = ROOT / "models" / "qwen3-14b"


@pytest.mark.parametrize("tokens", [10, 374, 1024, 6000])
def test_prompt_builder_gives_exactly_the_recorded_tokens(tokens: int) -> None:
    counter = load_counter(QWEN)
    body = PromptBuilder(counter).body(RequestSpec(arrival_s=0, prompt_tokens=tokens,
                                                   output_tokens=5),
                                       behaviour=Behaviour.CAP_2048)
    assert counter.count_chat(ChatRequest(messages=body["messages"])) == tokens


def test_trace_replay_keeps_lengths_and_compresses_time() -> None:
    rows = load_azure("azure_llm_2023_conv_slice.csv")
    assert len(rows) == 3000
    assert (rows[0].prompt_tokens, rows[0].output_tokens) == (374, 44)
    specs = replay(rows, rate_per_s=20.0, duration_s=30.0, max_prompt=6000, max_output=1000,
                   start=300)
    assert all(s.arrival_s < 30.0 for s in specs)
    assert 400 < len(specs) < 800  # about 20 req/s; the trace's own bursts remain
    assert specs[0].prompt_tokens == min(6000, rows[300].prompt_tokens)
    assert specs[0].output_tokens == min(1000, rows[300].output_tokens)


def test_load_calibration_follows_littles_law() -> None:
    params = SimParams()
    specs = [RequestSpec(arrival_s=0, prompt_tokens=1000, output_tokens=200)] * 10
    # 32,768 / 1,200 tokens = 27.3 running, 13.65 per backend: step 22.73 ms;
    # service 200 x 22.73 ms = 4.546 s; 1x = 27.3 / 4.546 = 6.01 req/s
    assert rate_for(1.0, specs, params) == pytest.approx(6.006, abs=0.01)
    assert rate_for(2.0, specs, params) == pytest.approx(2 * rate_for(1.0, specs, params))


def test_synthetic_and_hol_mixes_are_seeded_and_bounded() -> None:
    a = synthetic_mix(rate_per_s=5, duration_s=20, seed=1, max_prompt=6000, max_output=1000)
    assert a == synthetic_mix(rate_per_s=5, duration_s=20, seed=1, max_prompt=6000,
                              max_output=1000)
    assert max(s.prompt_tokens for s in a) <= 6000
    hol = hol_mix(rate_per_s=5, duration_s=40, seed=2)
    assert {s.kind for s in hol} == {"short", "long"}


def test_group_prompts_share_exactly_the_system_prompt() -> None:
    """G / Gz: one system prompt per group, byte-identical within it and distinct
    across; a question of each request's own; every prompt exactly its token count;
    the Zipf variant has one hot group."""
    counter = load_counter(QWEN)
    builder = PromptBuilder(counter)
    kw = {"rate_per_s": 20.0, "duration_s": 30.0, "outputs": [10, 200, 900],
          "prompt_overhead": builder.group_overhead}
    uniform = group_prompts(seed=1, **kw)  # type: ignore[arg-type]
    skewed = group_prompts(seed=1, zipf_s=1.2, **kw)  # type: ignore[arg-type]
    assert uniform == group_prompts(seed=1, **kw)  # type: ignore[arg-type]  # seeded
    assert {s.output_tokens for s in uniform} <= {10, 200, 900}
    systems: dict[int, set[str]] = {}
    questions = set()
    for spec in uniform[:80]:
        body = builder.body(spec, behaviour=Behaviour.NONE)
        system, user = body["messages"]
        assert system["role"] == "system" and user["role"] == "user"
        systems.setdefault(spec.group, set()).add(system["content"])
        questions.add(user["content"])
        assert counter.count_chat(ChatRequest(messages=body["messages"])) == spec.prompt_tokens
        assert spec.prompt_tokens == 2048 + 256 + builder.group_overhead
        assert len(counter.prompt_token_ids(system["content"])) == 2048
        assert len(counter.prompt_token_ids(user["content"])) == 256
    assert len(systems) == 8 and all(len(texts) == 1 for texts in systems.values())
    texts = [next(iter(t)) for t in systems.values()]
    assert len({t[:200] for t in texts}) == 8  # distinct from their first words
    assert len(questions) == 80
    share = [sum(s.group == g for s in skewed) / len(skewed) for g in range(8)]
    assert share[0] > 0.35 and max(share[1:]) < 0.25  # one hot group
    flat = [sum(s.group == g for s in uniform) / len(uniform) for g in range(8)]
    assert max(flat) < 0.2


def test_mooncake_conversations_keep_whole_conversations_and_their_shared_prefixes() -> None:
    """M: every turn of a conversation taken comes with it; equal leading block ids give
    byte-identical prompt text, one id's text never differs; every prompt exactly its
    scaled, clipped token count; arrivals compressed into the window in order."""
    counter = load_counter(QWEN)
    builder = PromptBuilder(counter)
    rows = load_mooncake("mooncake_conversation_slice.jsonl")
    assert len(rows) == 1750 and max(r.offset_s for r in rows) < 600
    kw = {"window_s": 600.0, "duration_s": 20.0, "block_tokens": 64,
          "prompt_overhead": builder.user_overhead, "max_prompt": 6000, "max_output": 1000}
    specs = mooncake_conversations(rows, count=120, **kw)  # type: ignore[arg-type]
    assert specs == mooncake_conversations(rows, count=120, **kw)  # type: ignore[arg-type]
    assert 120 <= len(specs) < 200
    assert [s.arrival_s for s in specs] == sorted(s.arrival_s for s in specs)
    assert specs[0].arrival_s >= 0 and specs[-1].arrival_s < 20.0
    # whole conversations: every window row with a taken conversation's key is taken
    taken = {s.blocks[1] for s in specs if len(s.blocks) > 1}
    window_rows = [r for r in rows if len(r.hash_ids) > 1 and r.hash_ids[1] in taken]
    assert len(window_rows) == sum(1 for s in specs if len(s.blocks) > 1)
    text_of: dict[int, str] = {}
    for spec in specs[:60]:
        row = rows[spec.uid]
        content = min(row.prompt_tokens * 64 // 512, 6000 - builder.user_overhead)
        assert spec.prompt_tokens == content + builder.user_overhead
        assert spec.blocks == row.hash_ids[:-(-content // 64)]
        assert spec.output_tokens == min(row.output_tokens, 1000)
        (message,) = builder.body(spec, behaviour=Behaviour.NONE)["messages"]
        assert counter.count_chat(ChatRequest(messages=[message])) == spec.prompt_tokens
        text = message["content"]
        words = text.split(" ")[1:]
        for i, block in enumerate(spec.blocks):  # a block's text: its 64 words, or fewer
            piece = " ".join(words[64 * i:64 * (i + 1)])
            known = text_of.setdefault(block, piece)
            assert known.startswith(piece) or piece.startswith(known)
            if len(piece.split(" ")) == 64:
                text_of[block] = piece
    # two turns of one conversation: the later one opens with the earlier one's text
    by_conv: dict[int, list[str]] = {}
    for spec in specs[:60]:
        if len(spec.blocks) > 2:
            body = builder.body(spec, behaviour=Behaviour.NONE)
            by_conv.setdefault(spec.blocks[1], []).append(body["messages"][0]["content"])
    pairs = [texts for texts in by_conv.values() if len(texts) > 1]
    assert pairs
    for texts in pairs:
        first, later = texts[0], texts[1]
        common = 0
        for a, b in zip(first.split(" "), later.split(" "), strict=False):
            if a != b:
                break
            common += 1
        assert common >= 2 * 64  # at least the shared block 0 and the conversation's own


def test_one_engine_holds_every_pool_and_yields_m_s_hit_rate_yardstick() -> None:
    """`one-engine`: one simulated backend with all four pools, clients straight to it,
    giving up at the deadline; its engine-reported hits are M's yardstick, and the
    acceptance line compares kvgate's hit rate with it."""
    rows = load_mooncake("mooncake_conversation_slice.jsonl")
    builder = PromptBuilder(load_counter(QWEN))
    specs = mooncake_conversations(rows, count=12, window_s=600.0, duration_s=2.0,
                                   block_tokens=64, prompt_overhead=builder.user_overhead,
                                   max_prompt=2000, max_output=8)
    params = SimParams(kv_tokens=4096, prefix_caching=True)
    target = Target.ONE_ENGINE
    assert target.gives_up and not target.proxy and target.label == ONE_ENGINE
    run = asyncio.run(run_target("M", specs, builder, params, target, Behaviour.CAP_2048,
                                 "fifo", target.label, Limits(duration_s=2.0, drain_s=3.0),
                                 5.0, backends=4))
    assert run.samples and {s.capacity for s in run.samples} == {4 * 4096}
    assert {len(s.kv_per_backend) for s in run.samples} == {1}
    one = prefix_summary(run, slo_ttft_s=3.0, window_s=2.0)
    assert one.completed == len(specs) and one.query_tokens > 0
    assert one.hit_tokens > 0  # a conversation's later turns reuse its earlier blocks
    assert one.hit_rate is not None
    line = acceptance_of_prefix("M", [replace(one, label=AWARE, hit_tokens=0.75 * one.hit_tokens),
                                      one])
    assert f"NOT MET: engine prefix hit rate >= 0.8x `{ONE_ENGINE}`" in line
    line = acceptance_of_prefix("M", [replace(one, label=AWARE), one])
    assert f"- MET: engine prefix hit rate >= 0.8x `{ONE_ENGINE}`" in line
    assert "= 1.00x" in line


def test_kvgate_targets_run_as_replicas_on_one_redis_and_end_with_nothing_held() -> None:
    """`--replicas`: the kvgate target runs as two replicas on a fresh redis-server, the
    clients spread over both, and after the drain the run records what kvgate still
    holds (ledger, leases, in flight, shared blocks, block keys in Redis): nothing."""
    builder = PromptBuilder(load_counter(QWEN))
    specs = group_prompts(rate_per_s=12.0, duration_s=2.0, seed=5, outputs=[8, 16, 32],
                          prompt_overhead=builder.group_overhead, groups=2,
                          system_tokens=512, question_tokens=32)
    params = SimParams(kv_tokens=4096, prefix_caching=True)
    target = Target.ADAPTIVE
    run = asyncio.run(run_target("G", specs, builder, params, target, Behaviour.CAP_2048,
                                 "fifo", target.label, Limits(duration_s=2.0, drain_s=4.0),
                                 5.0, backends=2, replicas=2))
    assert {r.backend for r in run.results} == {0, 1}  # both replicas took requests
    served = {r.backend for r in run.results if r.ok}
    assert served == {0, 1}, [(r.backend, r.status, r.code) for r in run.results]
    assert run.totals["replicas"] == 2
    ends = ("end_resident", "end_leases", "end_inflight", "end_shared", "end_refs")
    assert {k: run.totals[k] for k in ends} == dict.fromkeys(ends, 0.0)
    assert run.totals["kvgate_shared"] > 0  # the replicas charged the group prompts once
    note = end_state_note(run)
    assert note is not None and note.endswith("(all released)") and "2 replica(s)" in note
    held = replace(run, totals=run.totals | {"end_leases": 1.0})
    assert "1 leases" in (end_state_note(held) or "")
    single = replace(run, totals=run.totals | {"replicas": 1.0})
    assert end_state_note(single) is None  # one replica, nothing left: no note


def test_affinity_ring_hashes_the_leading_text_consistently() -> None:
    ring = AffinityRing(4)

    def body(system: str, question: str) -> dict[str, Any]:
        return {"messages": [{"role": "system", "content": system},
                             {"role": "user", "content": question}]}

    long_a, long_b = "a" * 3000, "b" * 3000
    # equal leading 2,048 characters: the same backend, whatever follows
    assert ring.backend(body(long_a, "one")) == ring.backend(body(long_a, "two"))
    assert AffinityRing.key(body(long_a, "one")) == ("system\n" + long_a)[:AFFINITY_CHARS]
    # short prompts: the key reaches into the question
    assert AffinityRing.key(body("s", "q")) == "system\ns\nuser\nq\n"
    # every backend owns some keys, and a second ring maps the same
    picks = [ring.backend(body(f"group {i} " + long_b, "q")) for i in range(400)]
    assert set(picks) == {0, 1, 2, 3}
    assert picks == [AffinityRing(4).backend(body(f"group {i} " + long_b, "q"))
                     for i in range(400)]
    # consistent: adding a fifth backend moves only the keys the new one takes
    five = [AffinityRing(5).backend(body(f"group {i} " + long_b, "q")) for i in range(400)]
    assert all(f in (p, 4) for p, f in zip(picks, five, strict=True))
    assert Target.AFFINITY_TIMEOUT.gives_up and not Target.AFFINITY_TIMEOUT.proxy
    assert Target.ADAPTIVE_PREFIX_OFF.prefix_sharing == "off"
    assert Target.ADAPTIVE.prefix_sharing == "auto"


def test_shared_calibration_counts_each_group_prompt_once() -> None:
    params = SimParams()
    specs = [RequestSpec(arrival_s=0, prompt_tokens=2317, output_tokens=259, group=0,
                         system_tokens=2048)] * 4
    # unshared: 2,576 tokens a request; shared: 16,384 - 2 x 2,048 room per backend,
    # 528 tokens a request
    assert rate_for_shared(1.0, specs, params, 4, 8) > 3 * rate_for(1.0, specs, params, 4)
    with pytest.raises(ValueError):
        rate_for_shared(1.0, specs, params, 1, 8)


def test_client_behaviours_on_the_wire() -> None:
    """What reaches a backend over HTTP: the true length only as sim_output_tokens, and
    max_tokens as the behaviour says (absent for `none`)."""
    seen: list[dict[str, Any]] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        seen.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    specs = [RequestSpec(arrival_s=0.01 * i, prompt_tokens=40 + i, output_tokens=17 + i)
             for i in range(3)]
    builder = PromptBuilder(load_counter(QWEN))

    async def scenario() -> None:
        async with fake_backend(chat) as base:
            for behaviour in Behaviour:
                run = await run_open_loop([base], specs, builder, hard_stop_s=10,
                                          behaviour=behaviour)
                assert all(r.ok and r.ttft_s is not None for r in run.results)

    asyncio.run(scenario())
    assert len(seen) == 9
    by_behaviour = dict(zip(Behaviour, (seen[0:3], seen[3:6], seen[6:9]), strict=True))
    for bodies in by_behaviour.values():
        assert sorted(b["sim_output_tokens"] for b in bodies) == [17, 18, 19]
        assert all("max_completion_tokens" not in b for b in bodies)
    assert all(b["max_tokens"] == b["sim_output_tokens"]
               for b in by_behaviour[Behaviour.RECORDED])
    assert [b["max_tokens"] for b in by_behaviour[Behaviour.CAP_2048]] == [2048] * 3
    assert all("max_tokens" not in b for b in by_behaviour[Behaviour.NONE])


def test_ttft_and_the_give_up_take_the_first_token_not_the_role_chunk() -> None:
    """A backend that sends its headers and role chunk at once and its first token
    0.3 s later: the TTFT is the token's, and a client that gives up after 0.15 s
    without a token gives up, role chunk or not."""
    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"index":0,"delta":{"role":"assistant",'
                         b'"content":""}}]}\n\n')
        await asyncio.sleep(0.3)
        await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    specs = [RequestSpec(arrival_s=0.0, prompt_tokens=40, output_tokens=1)]
    builder = PromptBuilder(load_counter(QWEN))

    async def scenario() -> None:
        async with fake_backend(chat) as base:
            patient = await run_open_loop([base], specs, builder, hard_stop_s=5,
                                          behaviour=Behaviour.NONE)
            hasty = await run_open_loop([base], specs, builder, hard_stop_s=5,
                                        give_up_s=0.15, behaviour=Behaviour.NONE)
        [done], [abandoned] = patient.results, hasty.results
        assert done.ok and done.ttft_s is not None and done.ttft_s >= 0.3
        assert abandoned.code == ABANDONED and abandoned.ttft_s is None

    asyncio.run(scenario())


def test_direct_timeout_client_abandons_and_the_engine_frees_its_place() -> None:
    """A waiting request given up at the deadline closes its connection and never runs."""
    builder = PromptBuilder(load_counter(QWEN))
    # 20 blocks: each 200-token prompt needs 13, so the second waits behind the first
    specs = [RequestSpec(arrival_s=0.0, prompt_tokens=200, output_tokens=60),
             RequestSpec(arrival_s=0.1, prompt_tokens=200, output_tokens=60)]

    async def scenario() -> dict[str, Any]:
        # no prefix caching: the builder's two prompts are the same text, which the
        # engine would share, and the second would not wait
        async with running_sim(kv_tokens=320, max_model_len=320, model="qwen3-14b",
                               model_dir=str(QWEN), prefix_caching=False,
                               output_length=OutputLength.MAX, decode_step_ms=25) as base:
            run = await run_open_loop([base], specs, builder, hard_stop_s=15, give_up_s=0.6,
                                      behaviour=Behaviour.NONE)
            first, second = run.results
            assert first.ok and first.tokens_out == 60  # stopped at sim_output_tokens
            assert second.code == ABANDONED
            assert second.latency_s is not None and 0.6 <= second.latency_s < 1.0
            async with aiohttp.ClientSession() as s, s.get(f"{base}/sim/state") as resp:
                state: dict[str, Any] = await resp.json()
            return state

    state = asyncio.run(scenario())
    assert state["waiting"] == state["running"] == state["blocks_used"] == 0
    assert state["generation_tokens_total"] == 60  # the abandoned one was never scheduled


def _sample(t: float, kv: float, waiting: int, queued: int | None) -> Sample:
    return Sample(t=t, kv_use=kv, resident=int(kv * 100), reserved=None, capacity=100,
                  queued=queued, engine_waiting=waiting, running=1, preemptions=0)


def test_summary_counts_misses_as_infinite_and_defines_saturation() -> None:
    spec = RequestSpec(arrival_s=0, prompt_tokens=10, output_tokens=5)
    ok = [Result(spec=spec, status=200, ttft_s=(i + 1) / 10, latency_s=1.0, queue_wait_s=0.0)
          for i in range(97)]
    missed = [Result(spec=spec, status=429, code="queue_timeout", latency_s=3.0),
              Result(spec=spec, status=200, code=ABANDONED, latency_s=3.0),
              Result(spec=spec, status=200, ttft_s=0.2, code="cut_at_benchmark_end")]
    run = Run(label="kvgate strict", results=ok + missed, samples=[
        _sample(0.0, 0.2, 0, 0), _sample(0.2, 0.6, 0, 3), _sample(0.4, 0.8, 2, None)])
    s = summarize(run, slo_ttft_s=3.0, window_s=10.0, gated=True)
    assert (s.completed, s.offered) == (97, 100)
    assert s.goodput_per_s == pytest.approx(3.0)  # TTFT 0.1..9.7 s: 30 within 3 s
    assert s.ttft_p99 == pytest.approx(9.7)
    assert s.ttft_p99_all is not None and math.isinf(s.ttft_p99_all)
    assert s.queue_wait_p99 == 0.0
    assert s.queue_wait_p99_all is not None and math.isinf(s.queue_wait_p99_all)
    assert s.rejections == {"queue_timeout": 1, ABANDONED: 1, "cut_at_benchmark_end": 1}
    assert s.kv_use_mean == pytest.approx((0.2 + 0.6 + 0.8) / 3)
    assert s.kv_use_saturated == pytest.approx(0.7)  # only samples with someone waiting
    assert s.saturated_share == pytest.approx(2 / 3)
    direct = summarize(run, slo_ttft_s=3.0, window_s=10.0, gated=False)
    assert direct.queue_wait_p99 is None and direct.queue_wait_p99_all is None


def test_report_sets_adaptive_against_the_foreknowledge_bound() -> None:
    goodput = {("recorded", "kvgate strict"): 5.0, ("cap-2048", "kvgate strict"): 2.0,
               ("cap-2048", "kvgate adaptive"): 4.5, ("none", "kvgate strict"): 1.0}
    text = _foreknowledge_bound(goodput, ["recorded", "cap-2048", "none"])
    assert "| cap-2048 | 2.25x | 2.50x | 90% |" in text
    assert "| none |" not in text  # no adaptive run for it: no row, no made-up figure
    assert _foreknowledge_bound({("cap-2048", "kvgate strict"): 2.0}, ["cap-2048"]) == ""


def test_kvgate_config_variants_and_toml(tmp_path: Path) -> None:
    sims = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    strict = kvgate_config(SimParams(), GateSettings(starvation_s=1.0), port=9, sims=sims)
    adaptive = kvgate_config(SimParams(), GateSettings(reservation="adaptive"), port=9,
                             sims=sims)
    assert strict["models"][0]["reservation"] == "strict"  # never left to the default
    assert adaptive["models"][0]["reservation"] == "adaptive"
    for config in (strict, adaptive):
        assert tomllib.loads(to_toml(config)) == config
    parsed = parse_config(tomllib.loads(to_toml(strict)), base=tmp_path)  # kvgate accepts it
    model = parsed.models[0]
    assert (model.max_model_len, model.output.name, model.capacity_tokens) == (
        8192, "fill", 16384)
    assert (parsed.queue.starvation_s, parsed.queue.default_deadline_s) == (1.0, 3.0)
    blind = kvgate_config(SimParams(), GateSettings(reservation="adaptive",
                                                    prefix_sharing="off"), port=9, sims=sims)
    assert strict["models"][0]["prefix_sharing"] == "auto"
    assert parse_config(tomllib.loads(to_toml(blind)), base=tmp_path).models[0] \
        .prefix_sharing.value == "off"


def test_cli_rejects_unknown_choices() -> None:
    args = parse_args(["--scenarios", "S2", "--behaviours", "cap-2048,none",
                       "--targets", "direct,direct+timeout,strict,adaptive"])
    assert args.scenarios == ["S2"] and args.behaviours == [Behaviour.CAP_2048, Behaviour.NONE]
    for bad in (["--behaviours", "cap-4096"], ["--targets", "kvgate"], ["--scenarios", "S9"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_suite_tiny_run_writes_report_and_plots(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--scenarios", "S2", "--behaviours", "none",
         "--targets", "direct+timeout,strict", "--duration", "3", "--drain", "2",
         "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = (tmp_path / "report.md").read_text()
    assert report.startswith("# kvgate benchmark report\n\nCommand: `python -m benchmarks.run "
                             "--scenarios S2 --behaviours none --targets direct+timeout,strict")
    assert "wall time" in report.splitlines()[2]
    for column in ("completed / offered", "goodput/s", "not completed (reason: n)",
                   "preemptions", "KV use mean / saturated", "TTFT p99 all / completed ms",
                   "queue wait p99 all / completed ms"):
        assert column in report, column
    rows: dict[str, list[str]] = {}
    for line in report.splitlines():  # the first table's rows (the refusals' come after)
        if line.startswith(("| direct+timeout |", "| kvgate strict |")):
            rows.setdefault(line.split("|")[1].strip(), line.split("|"))
    assert set(rows) == {"direct+timeout", "kvgate strict"}
    assert rows["kvgate strict"][5].strip() == "0"  # zero preemptions through kvgate
    assert rows["direct+timeout"][9].strip() == "- / -"  # no gateway queue to wait in
    assert (tmp_path / "S2-none.png").stat().st_size > 10_000


def test_bench_ledger_shared_prefix_cases_run_small() -> None:
    """`bench_ledger`'s dispatch case places every waiter alike both ways, and its
    shared-prefix pairs run and leave nothing reserved (a few cycles, a few ms)."""
    from benchmarks.bench_ledger import PREFIX_BLOCKS, dispatch_passes, shared_pair_rates
    from proxy.ledger import MemoryLedger

    def run(scan: bool) -> tuple[tuple[str, str, int], ...]:
        times = asyncio.run(dispatch_passes(scan_every_pass=scan, backends=2, waiters=20,
                                            per_backend=3, cycles=10, quiet=2, seconds=10))
        assert times.cycles == 10 and times.quiet_ms > 0 and times.cycle_ms > 0
        return times.decisions

    placed = run(True)
    assert len(placed) == 2 * 3 + 10
    # the first lease on each backend pays the prefix; every other one shares all of it
    assert sorted(shared for _, _, shared in placed) == [0, 0] + [16 * PREFIX_BLOCKS] * 14
    assert run(False) == placed
    ledger = MemoryLedger()
    rates = asyncio.run(shared_pair_rates(ledger, seconds=0.02, concurrency=1, rounds=1))
    assert min(rates.plain, rates.joined, rates.joined_wide, rates.first) > 0
    assert ledger.resident("gpu-a") == 0


def test_bench_gate_drives_both_settings_to_completion_and_leaves_nothing_held(
        tmp_path: Path) -> None:
    """`bench_gate`: both settings answer every request, only `auto` carries block keys,
    and neither ledger holds anything afterwards."""
    from benchmarks.bench_gate import cpu_us_per_request, gates, serve_one
    from benchmarks.bench_peers import bodies
    from proxy.metrics import Outcome

    async def main() -> None:
        served = await gates(tmp_path)
        try:
            for mode, (_, gate) in served.items():
                batch = bodies("shared", 12, stream=True, max_tokens=8, seed=7)
                assert await cpu_us_per_request(gate, batch, 4) > 0
                record = await serve_one(gate, batch[0])
                assert record.outcome == Outcome.COMPLETED and record.prompt_tokens
                # a lease's shared figure exists only where it brought keys
                assert (record.shared_tokens is not None) == (mode == "auto")
                assert [gate.ledger.resident(b.name) for b in gate.backends] == [0]
        finally:
            for runtime, _ in served.values():
                await runtime.close()

    asyncio.run(main())


def test_bench_peers_repeats_send_prompts_no_earlier_repeat_sent() -> None:
    """`bench_peers --repeat`: every repeat sends new "unique" prompts (a repeat that
    re-sent them let a count cache that still held them skip the count)."""
    import argparse
    import os

    from benchmarks.bench_peers import run_all
    from proxy.ports import free_port

    sent: list[list[str]] = []

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        sent[-1].append(body["messages"][-1]["content"])
        return web.json_response({"choices": [{"index": 0, "message": {
            "role": "assistant", "content": "x"}, "finish_reason": "stop"}]})

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        args = argparse.Namespace(workloads=["unique"], concurrency=[2], requests=8,
                                  rounds=2, max_tokens=4, engine=None,
                                  modes=["json", "stream"])
        try:
            for repeat in range(2):
                sent.append([])
                targets = ("direct", "floor", "kvgate")  # all three: one recording mock
                await run_all(dict.fromkeys(targets, f"http://127.0.0.1:{port}"),
                              dict.fromkeys(targets, os.getpid()), args, repeat)
        finally:
            await runner.cleanup()

    asyncio.run(main())
    first, second = (set(prompts) for prompts in sent)
    assert len(sent[0]) == len(sent[1]) > 24  # 3 targets: warm-up, json, stream, 2 rounds
    assert len(first) == len(sent[0]) and first.isdisjoint(second)


def test_bench_peers_alternates_the_order_of_targets_round_by_round() -> None:
    """`bench_peers` rounds run the targets in turn, in reverse every other round (a
    target's place in the round biased it by up to 15%), and `--modes json` sends only
    one-body answers. Each target is its own port of one recording mock."""
    import argparse
    import itertools
    import os

    from benchmarks.bench_peers import run_all
    from proxy.ports import free_port

    seen: list[tuple[int, bool]] = []  # (port, stream) of each request, in order

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append((request.transport.get_extra_info("sockname")[1], body.get("stream")))
        return web.json_response({"choices": [{"index": 0, "message": {
            "role": "assistant", "content": "x"}, "finish_reason": "stop"}]})

    targets = ("direct", "floor", "kvgate")
    ports = {t: free_port() for t in targets}

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        for port in ports.values():
            await web.TCPSite(runner, "127.0.0.1", port).start()
        args = argparse.Namespace(workloads=["unique"], concurrency=[1], requests=200,
                                  rounds=4, max_tokens=4, engine=None, modes=["json"])
        try:
            await run_all({t: f"http://127.0.0.1:{p}" for t, p in ports.items()},
                          dict.fromkeys(targets, os.getpid()), args)
        finally:
            await runner.cleanup()

    asyncio.run(main())
    by_port = {p: t[0] for t, p in ports.items()}
    runs = "".join(by_port[port] for port, _ in seen)
    # warm-up d f k, then rounds d f k | k f d | d f k | k f d (a quarter of 200 at c=1:
    # 50 requests a cell, 12 a round; the warm-up sends 2)
    blocks = [runs[0]] + [b for a, b in itertools.pairwise(runs) if a != b]
    assert "".join(blocks) == "dfkdfkfdfkfd", "".join(blocks)
    assert runs.count("k") == 2 + 4 * 12
    assert not any(stream for _, stream in seen)


def test_a_refused_client_retries_once_after_retry_after_with_its_ticket() -> None:
    """Over HTTP: the first try of each request is refused (429, `retry-after-ms`, a
    ticket); the client waits what it was told, sends the ticket back once, and its
    TTFT counts from the first try's send. Without retries it stays refused."""
    seen: list[str | None] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        ticket = request.headers.get("x-kvgate-ticket")
        seen.append(ticket)
        if ticket is None:
            return web.json_response(
                {"error": {"code": "queue_timeout", "message": "no capacity for model 'm' "
                           "within the deadline: predicted to wait 900 ms more for 10 "
                           "tokens with 100 ms left; refused before it"}},
                status=429, headers={"Retry-After": "1", "retry-after-ms": "150",
                                     "x-kvgate-ticket": f"t{len(seen)}"})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    specs = [RequestSpec(arrival_s=0.05 * i, prompt_tokens=40, output_tokens=1)
             for i in range(3)]
    builder = PromptBuilder(load_counter(QWEN))

    async def scenario() -> tuple[Run, Run]:
        async with fake_backend(chat) as base:
            once = await run_open_loop([base], specs, builder, hard_stop_s=10,
                                       behaviour=Behaviour.NONE)
            seen.clear()
            again = await run_open_loop([base], specs, builder, hard_stop_s=10,
                                        behaviour=Behaviour.NONE, retries=1)
        return once, again

    once, again = asyncio.run(scenario())
    assert all(r.status == 429 and r.first is None and r.ticket for r in once.results)
    assert sorted(t for t in seen if t is not None) == ["t1", "t2", "t3"]  # each its own
    for r in again.results:
        assert r.ok and r.first is not None and r.first.status == 429
        assert r.retry_wait_s == pytest.approx(0.15)  # retry-after-ms read before Retry-After
        assert r.sent_s - r.first.sent_s >= 0.15
        assert r.ttft_s is not None and r.ttft_s >= r.from_first_s >= 0.15
    s = summarize_refusals(again, slo_ttft_s=3.0)
    assert (s.first.n, s.retried, s.retry_admitted, s.retry_good) == (3, 3, 3, 3)
    assert list(s.first_by_reason) == ["queue_timeout (predicted)"]
    assert summarize_refusals(once, slo_ttft_s=3.0).retried == 0
    with pytest.raises(ValueError):
        asyncio.run(run_open_loop(["http://127.0.0.1:9"], specs, builder, hard_stop_s=1,
                                  behaviour=Behaviour.NONE, retries=2))


def test_refusal_figures_and_capacity_left_unused() -> None:
    spec = RequestSpec(arrival_s=0, prompt_tokens=10, output_tokens=5)
    fast = [Result(spec=spec, status=429, code="queue_full", latency_s=0.004 * (i + 1))
            for i in range(9)]
    slow = Result(spec=spec, status=429, code="queue_timeout", latency_s=3.0,
                  message="no capacity for model 'm' within the deadline: waited 3000 ms")
    refused_first = Result(spec=spec, status=429, code="queue_timeout", latency_s=0.01,
                           message="... refused before it", sent_s=1.0, retry_after_s=3.5)
    retried = Result(spec=spec, status=200, ttft_s=2.5, latency_s=3.0, sent_s=2.0,
                     first=refused_first, from_first_s=1.0, queue_wait_s=0.2,
                     retry_wait_s=1.0)
    late = Result(spec=spec, status=200, ttft_s=3.5, latency_s=4.0, sent_s=2.0,
                  first=refused_first, from_first_s=1.0)
    waiting = Result(spec=spec, code=CUT, first=refused_first)  # retry never sent
    samples = [replace(_sample(t / 10, kv, 0, q), capacity=1000,
                       target_per_backend=(400, 400), reserved_per_backend=(300, 400))
               for t, kv, q in ((0, 0.5, 0), (1, 0.4, 2), (2, 0.9, 1), (3, 0.9, 0),
                                (4, 0.1, 0))]
    run = Run(label="kvgate adaptive +retry", results=[*fast, slow, retried, late, waiting],
              samples=samples, preemptions=1)
    s = summarize_refusals(run, slo_ttft_s=3.0)
    assert s.first.n == 13 and s.first.fast_share == pytest.approx(12 / 13)
    assert s.first_by_reason["queue_full"].n == 9
    assert s.first_by_reason["queue_timeout (waited)"].p99 == 3.0
    assert s.first_by_reason["queue_timeout (predicted)"].n == 3
    assert (s.retried, s.retry_admitted, s.retry_good, s.retry_cut) == (2, 2, 1, 1)
    assert s.retry_rate == 1.0 and s.admitted == 2
    assert s.retry_after_p50 == s.retry_after_max == 3.5 and s.retry_wait_p50 == 1.0
    # waiting from 0.1 s to 0.3 s: free 60% then 10% of 1,000 tokens, 0.1 s each
    assert s.waiting_s == pytest.approx(0.2)
    assert s.unused_token_s == pytest.approx(60 + 10)
    assert s.unreserved_token_s == pytest.approx(100 * 0.2)
    assert s.unused_share == pytest.approx(70 / 200)
    assert s.engine_ttft_p99 == pytest.approx(3.5 - 1.0)  # the later retry, on its own clock
    text = refusal_table([s])
    assert "| kvgate adaptive +retry | 13 of 13 | 92% |" in text
    assert "| 3,500 / 3,500 | 2; 1 cut waiting (1,000) | 2 (100%) | 1 |" in text
    verdict = acceptance("S2", {"direct": 1.0, "direct+timeout": 2.0,
                                "kvgate adaptive +retry": 2.1},
                         {"kvgate adaptive +retry": s}, 3.0)
    assert "- MET: refusals >= 90% answered within 50 ms: 92% of 13" in verdict
    assert "- MET: a retry after Retry-After admitted >= 60%: 2 of 2 = 100%" in verdict
    assert "- NOT MET: goodput >= 1.1x direct+timeout: 2.10 / 2.00 = 1.05x" in verdict
    assert "- NOT MET: preemptions <= 1% of admitted: 1 of 2" in verdict


def test_bursty_long_prompts_are_seeded_bursty_and_bounded() -> None:
    a = bursty_long_prompts(rate_per_s=20.0, duration_s=60.0, seed=5, max_prompt=6000,
                            max_output=200)
    assert a == bursty_long_prompts(rate_per_s=20.0, duration_s=60.0, seed=5,
                                    max_prompt=6000, max_output=200)
    assert all(0 <= s.arrival_s < 60.0 for s in a)
    assert all(256 <= s.prompt_tokens <= 6000 and 8 <= s.output_tokens <= 200 for s in a)
    assert 2000 < statistics.median(s.prompt_tokens for s in a) < 4500
    assert 30 < statistics.median(s.output_tokens for s in a) < 120
    # on-off: gaps of a second or more between bursts, the mean rate about half the peak
    gaps = [b.arrival_s - x.arrival_s for x, b in pairwise(a)]
    assert sum(1 for g in gaps if g >= 1.0) >= 5
    assert 0.25 * 20 < len(a) / 60.0 < 0.75 * 20


def test_suite_tiny_bursty_run_with_retries_reports_refusals(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--scenarios", "B", "--behaviours", "none",
         "--targets", "adaptive", "--duration", "3", "--drain", "2", "--retries", "1",
         "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = (tmp_path / "report.md").read_text()
    assert "## B: Bursty long prompts" in report
    for column in ("refused on first try", "within 50 ms", "refusal p50 / p99 ms",
                   "admitted on the retry (rate)", "KV free while requests waited"):
        assert column in report, column
    assert "| kvgate adaptive |" in report and "| kvgate adaptive +retry |" in report
    assert "Acceptance (issue #22, B, `none`)" in report
    assert (tmp_path / "B-none-timeline.png").stat().st_size > 10_000
