"""The benchmark suite: what kvgate buys on real traffic shapes, direct vs through kvgate.

    .venv/bin/python -m benchmarks.run [--out benchmarks/results/run] [--duration 15]

Every scenario runs twice on fresh processes, once straight to two simulated GPU
backends (16,384 KV tokens each) and once through kvgate, with the same requests at
the same times. Loads are calibrated against the pool: 1x means the offered resident
tokens equal the capacity. Bounded: each run stops `duration + 15` seconds after its
start, cutting whatever is still open. Writes report.md and PNG plots to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.suite.cluster import SimParams, cluster
from benchmarks.suite.loadgen import Run, run_closed_loop, run_open_loop
from benchmarks.suite.report import Summary, pct, plot, summarize, table
from benchmarks.suite.workloads import (
    PromptBuilder,
    RequestSpec,
    burst,
    hol_mix,
    load_azure,
    replay,
    synthetic_mix,
)
from proxy.tokenize import load_counter

ROOT = Path(__file__).resolve().parent.parent
SLO_TTFT_S = 3.0
DEADLINE_S = 3.0
MAX_PROMPT, MAX_OUTPUT = 6000, 1000


def rate_for(load: float, specs: list[RequestSpec], params: SimParams) -> float:
    """Arrival rate at which offered resident tokens are `load` x the KV capacity.

    Little's law: resident = rate x service time x tokens per request. Service time is
    the output length times the step time at the concurrency the pool allows.
    """
    capacity = 2 * params.kv_tokens
    per_request = statistics.mean(s.prompt_tokens + s.max_tokens for s in specs)
    running_per_backend = capacity / 2 / per_request
    service_s = statistics.mean(s.max_tokens for s in specs) * params.step_s(running_per_backend)
    return load * capacity / (per_request * service_s)


def rescale(specs: list[RequestSpec], factor: float) -> list[RequestSpec]:
    return [replace(s, arrival_s=s.arrival_s / factor) for s in specs]


async def _run_pair(name: str, specs: list[RequestSpec], builder: PromptBuilder,
                    params: SimParams, duration_s: float, orderings: list[str]) -> list[Run]:
    runs: list[Run] = []
    for ordering in ["direct", *orderings]:
        proxy = ordering != "direct"
        label = "direct" if not proxy else f"kvgate {ordering}"
        with cluster(params, proxy=proxy, ordering=ordering if proxy else "fifo",
                     deadline_s=DEADLINE_S) as c:
            run = await run_open_loop(
                c.targets, specs, builder, hard_stop_s=duration_s + 15,
                deadline_s=DEADLINE_S if proxy else None, label=f"{name}: {label}",
                sampler=c.sample)
            run.samples = c.samples
            run.preemptions = await c.preemptions()
        run.label = label
        runs.append(run)
    return runs


async def scenarios(out: Path, duration_s: float, only: set[str] | None) -> list[str]:
    params = SimParams()
    builder = PromptBuilder(load_counter(ROOT / "models" / "qwen3-14b"))
    conv = load_azure("azure_llm_2023_conv_slice.csv")
    lengths = replay(conv, rate_per_s=1.0, duration_s=10**6, max_prompt=MAX_PROMPT,
                     max_output=MAX_OUTPUT)
    one_x = rate_for(1.0, lengths, params)
    synth_unit = synthetic_mix(rate_per_s=1.0, duration_s=duration_s * 40, seed=3,
                               max_prompt=MAX_PROMPT, max_output=MAX_OUTPUT)
    synth_one_x = rate_for(1.0, synth_unit, params)

    # The slice's first minute is sparse (the trace starts mid-stream): skip it.
    def conv_at(load: float, start: int = 300, span: float = duration_s) -> list[RequestSpec]:
        return replay(conv, rate_per_s=load * one_x, duration_s=span, max_prompt=MAX_PROMPT,
                      max_output=MAX_OUTPUT, start=start)

    burst_specs = burst(
        conv_at(0.5),
        [replace(s, arrival_s=s.arrival_s + 3.0) for s in conv_at(5.0, start=1500, span=4.0)],
    )
    hol = hol_mix(rate_per_s=1.0, duration_s=duration_s * 20, seed=11)
    hol = [s for s in rescale(hol, 1.5 * rate_for(1.0, hol, params)) if s.arrival_s < duration_s]
    plan: list[tuple[str, str, list[RequestSpec], list[str]]] = [
        ("S1", "Under capacity (0.5x), Azure conversation trace", conv_at(0.5), ["fifo"]),
        ("S2", "2x overload, Azure conversation trace", conv_at(2.0), ["fifo"]),
        ("S2s", "2x overload, synthetic mix (lognormal, 2% very long)",
         [s for s in rescale(synth_unit, 2.0 * synth_one_x) if s.arrival_s < duration_s],
         ["fifo"]),
        ("S3", "5x burst for 4 s on a 0.5x base, then recovery, Azure conversation lengths",
         burst_specs, ["fifo"]),
        ("S4", "Mixed short and very long requests (1.5x), per ordering policy", hol,
         ["fifo", "shortest-first", "priority"]),
    ]
    sections = [
        f"Pool: 2 simulated backends x {params.kv_tokens:,} KV tokens; decode step "
        f"{params.decode_step_ms} ms + {params.per_seq_ms} ms per running sequence; prefill "
        f"{params.prefill_tokens_per_s:,.0f} tokens/s. 1x = {one_x:.2f} req/s on the Azure "
        f"conversation lengths (prompts clipped to {MAX_PROMPT}, outputs to {MAX_OUTPUT}). "
        f"TTFT SLO for goodput: {SLO_TTFT_S} s. kvgate queue deadline: {DEADLINE_S} s, "
        "depth 256. Every run is bounded at duration + 15 s; 'cut' counts requests still "
        "open then.",
    ]
    for key, title, specs, orderings in plan:
        if only and key not in only:
            continue
        print(f"{key}: {title} ({len(specs)} requests)", file=sys.stderr, flush=True)
        runs = await _run_pair(key, specs, builder, params, duration_s, orderings)
        summaries = [summarize(r, slo_ttft_s=SLO_TTFT_S, window_s=duration_s) for r in runs]
        image = out / f"{key}.png"
        plot(runs, f"{key}: {title}", image)
        sections.append(f"## {key}: {title}\n\n{len(specs)} requests over {duration_s:.0f} s."
                        f"\n\n{table(summaries)}\n\n{_verdict(summaries, runs)}\n\n"
                        f"![{key}]({image.name})")
        if key == "S4":
            sections.append(_short_requests(runs))
    return sections


def _verdict(summaries: list[Summary], runs: list[Run]) -> str:
    notes = []
    for s in summaries:
        if s.label == "direct":
            notes.append(f"direct: {s.preemptions} preemptions, TTFT p99 {_s(s.ttft_p99)}, "
                         f"{s.cut} requests still open at the cut")
            continue
        over = s.worst_timeout_overshoot_s
        full = s.worst_queue_full_answer_s
        notes.append(
            f"{s.label}: {s.preemptions} preemptions, TTFT p99 {_s(s.ttft_p99)} (bound: "
            f"deadline {DEADLINE_S:.0f} s + service); queue_timeout answered at most "
            f"{'-' if over is None else f'{over * 1000:.0f} ms'} past the deadline; "
            f"queue_full answered within {'-' if full is None else f'{full * 1000:.0f} ms'}")
    return "\n".join(f"- {n}" for n in notes)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _short_requests(runs: list[Run]) -> str:
    lines = ["Short requests only (the ones head-of-line blocking hurts):", "",
             "| run | short completed | short TTFT p50 / p99 ms | long completed |",
             "|---|---|---|---|"]
    for run in runs:
        short = [r.ttft_s for r in run.results
                 if r.spec.kind == "short" and r.ok and r.ttft_s is not None]
        longs = sum(1 for r in run.results if r.spec.kind == "long" and r.ok)
        p50, p99 = pct(short, 0.5) or 0.0, pct(short, 0.99) or 0.0
        lines.append(f"| {run.label} | {len(short)} | {p50 * 1000:,.0f} / {p99 * 1000:,.0f} "
                     f"| {longs} |")
    return "\n".join(lines)


async def overhead(requests_scale: float) -> str:
    """Added latency and throughput ratio vs direct, memory and Redis ledgers (closed loop)."""
    from tests.support.redis_server import RedisServer

    params = SimParams(kv_tokens=1_000_000, decode_step_ms=1.0, per_seq_ms=0.0,
                       prefill_tokens_per_s=0.0)
    builder = PromptBuilder(load_counter(ROOT / "models" / "qwen3-14b"))
    lines = ["| ledger | mode | concurrency | direct p50 / p99 ms | kvgate p50 / p99 ms | "
             "added p50 / p99 ms | throughput ratio |", "|---|---|---|---|---|---|---|"]

    async def measure(url: str, n: int, conc: int, stream: bool) -> tuple[list[float], float]:
        specs = [RequestSpec(arrival_s=0, prompt_tokens=24, max_tokens=32)] * n
        run = await run_closed_loop(url, specs, builder, concurrency=conc, hard_stop_s=120,
                                    stream=stream)
        latencies = [r.latency_s for r in run.results if r.ok and r.latency_s is not None]
        if len(latencies) != n:
            raise RuntimeError(f"{n - len(latencies)} of {n} overhead requests failed")
        return latencies, n / run.duration_s

    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp))
        redis.start()
        try:
            for ledger in ("memory", "redis"):
                with cluster(params, proxy=True, max_depth=4096,
                             ledger_url=redis.url if ledger == "redis" else None) as c:
                    assert c.proxy is not None
                    for stream in (False, True):
                        for conc in (1, 32, 128):
                            n = max(40, int(conc * 2 * requests_scale))
                            await measure(c.sims[0], min(n, 64), conc, stream)  # warm up
                            await measure(c.proxy, min(n, 64), conc, stream)
                            d_lat, d_tp = await measure(c.sims[0], n, conc, stream)
                            p_lat, p_tp = await measure(c.proxy, n, conc, stream)
                            d = (pct(d_lat, 0.5) or 0.0, pct(d_lat, 0.99) or 0.0)
                            p = (pct(p_lat, 0.5) or 0.0, pct(p_lat, 0.99) or 0.0)
                            lines.append(
                                f"| {ledger} | {'stream' if stream else 'json'} | {conc} | "
                                f"{d[0] * 1e3:.1f} / {d[1] * 1e3:.1f} | "
                                f"{p[0] * 1e3:.1f} / {p[1] * 1e3:.1f} | "
                                f"{(p[0] - d[0]) * 1e3:.1f} / {(p[1] - d[1]) * 1e3:.1f} | "
                                f"{p_tp / d_tp:.3f} |")
        finally:
            redis.stop()
    return ("## Proxy overhead\n\nClosed loop, 24-token prompts, 32 output tokens, 1 ms "
            "decode step, the same backend direct and through kvgate (one run).\n\n"
            + "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "run"))
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--only", nargs="*", help="scenario keys, e.g. S2 S4; 'overhead'")
    parser.add_argument("--overhead-scale", type=float, default=1.0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    only = set(args.only) if args.only else None
    started = time.perf_counter()
    sections = asyncio.run(scenarios(out, args.duration, only))
    if only is None or "overhead" in only:
        sections.append(asyncio.run(overhead(args.overhead_scale)))
    elapsed = time.perf_counter() - started
    report = ("# kvgate benchmark report\n\n"
              f"Command: `python -m benchmarks.run {' '.join(sys.argv[1:])}`; "
              f"wall time {elapsed:.0f} s.\n\n" + "\n\n".join(sections) + "\n")
    (out / "report.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
