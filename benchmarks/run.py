"""The benchmark suite: what kvgate buys on real traffic shapes, against honest baselines.

    python -m benchmarks.run [--scenarios S2] [--behaviours cap-2048,none]
        [--targets direct,direct+timeout,strict,adaptive] [--duration 20 | --quick]

Every (scenario, client behaviour, target) runs on fresh processes: two simulated GPU
backends (16,384 KV tokens each), and kvgate in front for the kvgate targets, with the
same requests at the same times. Each request carries its recorded output length as
`sim_output_tokens`, where the simulated model stops as at EOS; the behaviour decides
what the client sends as `max_tokens` (the recorded length, a 2,048 cap, or nothing).
Loads are calibrated against the pool at the recorded lengths: 1x means the offered
resident tokens equal the capacity. Bounded: each run stops `duration + drain` seconds
after its start, cutting whatever is still open. Writes report.md and PNG plots to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.suite.cluster import GateSettings, SimParams, StartFailed, Target, cluster
from benchmarks.suite.engine_run import (
    DEADLINE_S,
    DEFAULT_STARVATION_S,
    SLO_TTFT_S,
    Limits,
    Scenario,
    engine_sections,
    notes_of,
    run_target,
    runs_for,
)
from benchmarks.suite.llamacpp import LlamaParams, llama_engine, llama_header, probe
from benchmarks.suite.loadgen import RETRY_CAP_S, Run, run_closed_loop
from benchmarks.suite.plan import (
    HOL_STARVATION_S,
    SCENARIOS,
    plan_scenarios,
)
from benchmarks.suite.plan import (
    rate_for as rate_for,  # the tests' and callers' name for it: benchmarks.run.rate_for
)
from benchmarks.suite.plan import (
    rate_for_shared as rate_for_shared,
)
from benchmarks.suite.refusals import acceptance as deadline_acceptance
from benchmarks.suite.refusals import refusal_table, summarize_refusals, timeline
from benchmarks.suite.report import (
    Summary,
    acceptance,
    by_class,
    class_table,
    ms,
    pct,
    plot,
    prefix_summary,
    prefix_table,
    summarize,
    table,
)
from benchmarks.suite.vllm import VllmParams, VllmPool, vllm_header, vllm_probe, vllm_version
from benchmarks.suite.workloads import Behaviour, PromptBuilder, RequestSpec, load_azure, replay
from proxy.tokenize import load_counter

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("sim", "llama.cpp", "vllm")
ENGINE_SCENARIOS = ("S1", "S2")
# llama.cpp: two servers of 4,096-token unified pools, 4 slots each; the trace clipped
# so that its longest request fits a pool with room to spare and ~3 mean requests fill one
LLAMA = LlamaParams(ctx_size=4096, parallel=4)
LLAMA_MAX_PROMPT, LLAMA_MAX_OUTPUT = 2000, 500
LLAMA_SCENARIOS = ENGINE_SCENARIOS
# vLLM CPU: two servers of 4,096-token pools (129 blocks of 32, one the null block),
# max_model_len 2,048 (a cap-2048 request is a whole context); the trace clipped so that
# its longest request fits a context and ~4 mean requests fill a pool
VLLM = VllmParams(num_blocks=129, block_size=32, max_model_len=2048, max_num_seqs=16)
VLLM_MAX_PROMPT, VLLM_MAX_OUTPUT = 1000, 250


def _refusal_part(key: str, behaviour: Behaviour, runs: list[Run],
                  summaries: list[Summary], out: Path) -> str:
    """Refusal latency, retries, capacity unused while requests waited; the acceptance
    of issue #22 where it names the scenario; the admission timeline."""
    refusals = [summarize_refusals(r, slo_ttft_s=SLO_TTFT_S) for r in runs]
    text = ("Refusals, retries and capacity left unused (a refusal's latency is from the "
            "client's send of that try to the 429/503; `+retry`: a refused client waits "
            f"its `retry-after-ms` / `Retry-After`, at most {RETRY_CAP_S:g} s, and tries "
            "once more with its `x-kvgate-ticket`; a retry counts toward goodput only if "
            "its first token comes within the SLO counted from the FIRST try's send (a "
            "refusal predicted at arrival tells the client to wait about its predicted "
            "wait, which is more than the time left to its deadline, so with the SLO equal "
            "to the deadline such a retry cannot count); "
            "`queue_timeout (predicted)`: refused before its deadline by kvgate's forecast, "
            "at arrival or later while queued; `(waited)`: when its deadline passed in the "
            "queue; KV free while requests waited: engine-reported free KV "
            "x time while kvgate's queue (for direct targets, an engine's queue) was "
            "non-empty, from the 0.2 s samples):\n\n" + refusal_table(refusals))
    if key in ("S2", "B") and any(r.label.startswith("kvgate adaptive") for r in runs):
        goodput = {s.label: s.goodput_per_s for s in summaries}
        text += (f"\n\nAcceptance (issue #22, {key}, `{behaviour}`):\n\n"
                 + deadline_acceptance(key, goodput, {r.label: r for r in refusals},
                                       DEADLINE_S))
    image = out / f"{key}-{behaviour}-timeline.png"
    timeline(runs, f"{key}, `{behaviour}`: admission timeline", image)
    return text + f"\n\n![{key} {behaviour} timeline]({image.name})"


def _long_requests(runs: list[Run]) -> str:
    """What the long requests of the head-of-line mix got, target by target: a first token
    (admitted and served) within the run, and completion before the hard stop."""
    lines = []
    for run in runs:
        longs = [r for r in run.results if r.spec.kind == "long"]
        if not longs:
            continue
        started = [r.ttft_s for r in longs if r.ttft_s is not None]
        c = next(c for c in by_class(run.results) if c.kind == "long")
        rest = ", ".join(f"{v} {k}" for k, v in sorted(c.outcomes.items())) or "none lost"
        ttft = (f" (TTFT p50 / max {ms(pct(started, 0.5))} / {ms(max(started))} ms)"
                if started else "")
        lines.append(f"- {run.label}: {len(started)} of {len(longs)} long requests got their "
                     f"first token{ttft}, {c.completed} completed before the hard stop; not "
                     f"completed: {rest}")
    return ("Long requests (5,000-token prompts, 1,200-token answers, about 25 s of decoding "
            "each, so only early arrivals can finish before the hard stop):\n\n"
            + "\n".join(lines))


async def scenario_sections(out: Path, scenario: Scenario, builder: PromptBuilder,
                            params: SimParams, behaviours: Sequence[Behaviour],
                            targets: Sequence[Target] | None, limits: Limits,
                            retries: int = 0, replicas: int = 1) -> list[str]:
    """`targets` None: the scenario's own set. `retries`: every kvgate target runs
    twice, its clients not retrying and (label `+retry`) retrying once after a
    refusal's Retry-After. `replicas`: every kvgate target runs as that many replicas
    on one Redis ledger, the clients spread over them round-robin."""
    params = scenario.params or params
    targets = scenario.targets if targets is None else targets
    prefix = scenario.key in ("G", "Gz", "M")
    sections = [f"## {scenario.key}: {scenario.title}\n\n{len(scenario.specs)} requests "
                f"arriving over {limits.duration_s:.0f} s; hard stop at "
                f"{limits.hard_stop_s:.0f} s. kvgate ordering: "
                f"{', '.join(scenario.orderings)}; starvation_s {scenario.starvation_s:g} s "
                + ("(below the deadline: a waiter that has waited that long holds the next "
                   "room; nobody backfills past it)." if scenario.starvation_s < DEADLINE_S
                   else "(not below the deadline: the head's protection never engages, "
                        "smaller requests always backfill).")]
    goodput: dict[tuple[Behaviour, str], float] = {}
    labels: list[str] = []
    for behaviour in behaviours:
        print(f"{scenario.key} {behaviour}: {len(scenario.specs)} requests", file=sys.stderr,
              flush=True)
        runs: list[Run] = []
        failed: list[str] = []
        plan = [(t, o, label, 0) for t, o, label in runs_for(scenario, targets)]
        if retries:
            plan += [(t, o, f"{label} +retry", retries) for t, o, label, _ in plan
                     if t.proxy]
        for target, ordering, label, tries in plan:
            try:
                runs.append(await run_target(scenario.key, scenario.specs, builder, params,
                                             target, behaviour, ordering, label, limits,
                                             scenario.starvation_s, scenario.backends,
                                             retries=tries, replicas=replicas))
            except StartFailed as exc:
                failed.append(f"{label}: {exc}")
            if label not in labels:
                labels.append(label)
        summaries = [summarize(r, slo_ttft_s=SLO_TTFT_S, window_s=limits.duration_s,
                               gated=r.label.startswith("kvgate")) for r in runs]
        for s in summaries:
            goodput[(behaviour, s.label)] = s.goodput_per_s
        image = out / f"{scenario.key}-{behaviour}.png"
        if runs:
            plot(runs, f"{scenario.key}, client behaviour `{behaviour}`: {scenario.title}",
                 image)
        part = (f"### {scenario.key}, client behaviour `{behaviour}`\n\n{table(summaries)}"
                f"\n\n{notes_of(summaries, failed, runs)}")
        if runs and not prefix:
            part += "\n\n" + _refusal_part(scenario.key, behaviour, runs, summaries, out)
        if prefix and runs:
            prefixed = [prefix_summary(r, slo_ttft_s=SLO_TTFT_S, window_s=limits.duration_s)
                        for r in runs]
            part += ("\n\nShared prefixes:\n\n" + prefix_table(prefixed) + "\n\n"
                     + acceptance(scenario.key, prefixed))
        if scenario.key == "S4" and runs:
            part += ("\n\nPer class:\n\n" + class_table(runs) + "\n\n" + _long_requests(runs))
        if runs:
            part += f"\n\n![{scenario.key} {behaviour}]({image.name})"
        sections.append(part)
    if "direct" in labels and len(behaviours) > 0:
        head = "| behaviour | " + " | ".join(labels) + " |"
        rows = [head, "|" + "---|" * (len(labels) + 1)]
        for behaviour in behaviours:
            base = goodput.get((behaviour, "direct"))
            cells = []
            for label in labels:
                g = goodput.get((behaviour, label))
                cells.append("-" if g is None or not base else f"{g / base:.2f}x")
            rows.append(f"| {behaviour} | " + " | ".join(cells) + " |")
        sections.insert(1, "Goodput relative to `direct`, per client behaviour:\n\n"
                           + "\n".join(rows))
    bound = _foreknowledge_bound(goodput, behaviours)
    if bound:
        sections.insert(2, bound)
    return sections


def _foreknowledge_bound(goodput: dict[tuple[Behaviour, str], float],
                         behaviours: Sequence[Behaviour]) -> str:
    """Adaptive against strict, next to what perfect foreknowledge would give.

    `kvgate strict` under the `recorded` behaviour reserves each request's true output
    length, which no real client can send: the most a reservation made at admission
    can serve. Its ratio to `strict` under a real client's behaviour is the gain exact
    output prediction would bring, so a reader can see how much of it adaptive gets.
    """
    strict, adaptive = "kvgate strict", "kvgate adaptive"
    oracle = goodput.get(("recorded", strict))
    rows = []
    for behaviour in behaviours:
        s, a = goodput.get((behaviour, strict)), goodput.get((behaviour, adaptive))
        if behaviour == "recorded" or not s or a is None or oracle is None:
            continue
        rows.append(f"| {behaviour} | {a / s:.2f}x | {oracle / s:.2f}x | "
                    f"{a / oracle:.0%} |")
    if not rows:
        return ""
    return ("Adaptive against strict, and the bound of a reservation made at admission: "
            "`kvgate strict` given each request's true output length (the `recorded` "
            "behaviour, which no real client can send) over `kvgate strict` under the same "
            "client behaviour:\n\n| behaviour | adaptive / strict | true length / strict | "
            "adaptive / true length |\n|---|---|---|---|\n" + "\n".join(rows))


async def overhead(requests_scale: float) -> str:
    """Added latency and throughput ratio vs direct, memory and Redis ledgers (closed loop)."""
    from tests.support.redis_server import RedisServer

    params = SimParams(kv_tokens=1_000_000, decode_step_ms=1.0, per_seq_ms=0.0,
                       prefill_tokens_per_s=0.0)
    builder = PromptBuilder(load_counter(ROOT / "models" / "qwen3-14b"))
    lines = ["| ledger | mode | concurrency | direct p50 / p99 ms | kvgate p50 / p99 ms | "
             "added p50 / p99 ms | throughput ratio |", "|---|---|---|---|---|---|---|"]

    async def measure(url: str, n: int, conc: int, stream: bool) -> tuple[list[float], float]:
        specs = [RequestSpec(arrival_s=0, prompt_tokens=24, output_tokens=32)] * n
        # A fixed cap, as a real client sends; the simulated engine still stops at 32.
        run = await run_closed_loop(url, specs, builder, concurrency=conc, hard_stop_s=120,
                                    behaviour=Behaviour.CAP_2048, stream=stream)
        latencies = [r.latency_s for r in run.results if r.ok and r.latency_s is not None]
        if len(latencies) != n:
            raise RuntimeError(f"{n - len(latencies)} of {n} overhead requests failed")
        return latencies, n / run.duration_s

    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp))
        redis.start()
        try:
            for ledger in ("memory", "redis"):
                gate = GateSettings(max_depth=4096, deadline_s=10.0,
                                    ledger_url=redis.url if ledger == "redis" else None)
                # One backend: direct and kvgate reach the same single engine.
                with cluster(params, gate=gate, backends=1) as c:
                    assert c.proxy is not None and len(c.sims) == 1
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
            "decode step; one simulated backend, reached by the client directly and through "
            "kvgate with that backend as its only one (one run).\n\n"
            + "\n".join(lines))


def _choices(value: str, allowed: Sequence[str], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(
            f"{what}: {', '.join(bad) or 'none given'}; choose from {', '.join(allowed)}")
    return items


def _revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown revision"
    return f"revision {rev or 'unknown'}{' with local changes' if dirty else ''}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "run"))
    parser.add_argument(
        "--scenarios", default=",".join(SCENARIOS),
        type=lambda v: _choices(v, SCENARIOS, "unknown scenario"),
        help=f"comma-separated, from {','.join(SCENARIOS)} (default: all)")
    parser.add_argument(
        "--behaviours", default=",".join(b.value for b in Behaviour),
        type=lambda v: [Behaviour(b) for b in _choices(v, [b.value for b in Behaviour],
                                                       "unknown behaviour")],
        help="what clients send as max_tokens: recorded, cap-2048, none (default: all)")
    parser.add_argument(
        "--targets",
        type=lambda v: [Target(t) for t in _choices(v, [t.value for t in Target],
                                                    "unknown target")],
        default=None,
        help="direct, direct+timeout, strict, adaptive, affinity+timeout, adaptive-prefix-off, "
             "one-engine (default: each scenario's own: S1-S4 the first four; G, Gz direct, "
             "direct+timeout, affinity+timeout, adaptive-prefix-off, adaptive; M those and "
             "one-engine, the hit-rate yardstick)")
    parser.add_argument("--s4-orderings", default="fifo",
                        type=lambda v: tuple(_choices(v, ["fifo", "shortest-first", "priority"],
                                                      "unknown ordering")),
                        help="kvgate orderings compared in S4 (default: fifo)")
    parser.add_argument("--orderings", default=None,
                        type=lambda v: tuple(_choices(v, ["fifo", "shortest-first", "priority"],
                                                      "unknown ordering")),
                        help="kvgate orderings compared in every scenario but S4 (default: "
                             "fifo; S4 takes --s4-orderings)")
    parser.add_argument("--starvation-s", type=float, default=None,
                        help=f"kvgate's starvation_s for every scenario (default "
                             f"{DEFAULT_STARVATION_S:g}, S4 {HOL_STARVATION_S:g})")
    parser.add_argument("--duration", type=float, default=None,
                        help="arrival window per run in seconds (default 20; --quick 8)")
    parser.add_argument("--drain", type=float, default=None,
                        help="seconds after the window before the hard stop (default 15; "
                             "--quick 6)")
    parser.add_argument("--prefix-calibration", choices=("unshared", "shared"),
                        default="shared",
                        help="what 2x means in G, Gz: Little's law on a pool holding each "
                             "group's system prompt once (shared, default) or on the whole "
                             "prompt per request (unshared)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="kvgate targets run as this many replicas on one Redis ledger "
                             "(a fresh redis-server per run; simulator engine only)")
    parser.add_argument("--group-load", type=float, default=2.0,
                        help="G and Gz: the offered load, in multiples of 1x (default 2)")
    parser.add_argument("--engine", choices=ENGINES, default="sim",
                        help="the backends: kvgate's simulator (default), two llama.cpp "
                             "llama-servers or two vLLM CPU servers (S1, S2 only; each "
                             "cell also runs on the simulator fitted to them unless "
                             "--no-sim-twin)")
    parser.add_argument("--no-sim-twin", action="store_true",
                        help="--engine llama.cpp / vllm: skip the fitted simulator's runs")
    parser.add_argument("--quick", action="store_true",
                        help="short windows for development: numbers are noisier")
    parser.add_argument("--overhead-scale", type=float, default=1.0)
    parser.add_argument("--retries", type=int, choices=(0, 1), default=0,
                        help="1: each kvgate target also runs with clients that retry a "
                             "refusal once after its Retry-After (at most "
                             f"{RETRY_CAP_S:g} s), sending its ticket (simulator engine)")
    return parser.parse_args(argv)


def engine_plan(engine: str, duration_s: float, wanted: set[str], sim: SimParams,
                max_prompt: int, max_output: int,
                starvation_s: float | None = None) -> tuple[list[Scenario], str]:
    """S1 / S2 for a real engine: the trace clipped to its small pools, calibrated on the
    simulator fitted to the servers (`Probe.sim_params`)."""
    bad = wanted - set(ENGINE_SCENARIOS)
    if bad:
        raise SystemExit(f"--engine {engine} runs {', '.join(ENGINE_SCENARIOS)} only; "
                         f"not {', '.join(sorted(bad))}")
    scenarios, header = plan_scenarios(duration_s, sim, wanted, ("fifo",), starvation_s,
                                       max_prompt=max_prompt, max_output=max_output)
    header = header.replace("Pool: 2 simulated", "The simulator twin's pool: 2 simulated", 1)
    header = header.replace("Every request carries", "Every request to the simulator carries",
                            1)
    return scenarios, header


def llama_plan(duration_s: float, wanted: set[str], llama: LlamaParams, sim: SimParams,
               starvation_s: float | None = None) -> tuple[list[Scenario], str]:
    return engine_plan("llama.cpp", duration_s, wanted, sim, LLAMA_MAX_PROMPT,
                       LLAMA_MAX_OUTPUT, starvation_s)


def vllm_plan(duration_s: float, wanted: set[str], sim: SimParams,
              starvation_s: float | None = None) -> tuple[list[Scenario], str]:
    return engine_plan("vllm", duration_s, wanted, sim, VLLM_MAX_PROMPT, VLLM_MAX_OUTPUT,
                       starvation_s)


def _mean_prompt(max_prompt: int, max_output: int) -> int:
    lengths = replay(load_azure("azure_llm_2023_conv_slice.csv"), rate_per_s=1.0,
                     duration_s=10**6, max_prompt=max_prompt, max_output=max_output)
    return round(statistics.mean(s.prompt_tokens for s in lengths))


def llama_sections(out: Path, wanted: set[str], builder: PromptBuilder,
                   args: argparse.Namespace, limits: Limits) -> list[str]:
    from tests.support.engines import llama_server_binary

    version_file = llama_server_binary().parents[1] / "version.txt"
    version = (version_file.read_text().strip() if version_file.exists()
               else llama_server_binary().parent.parent.name)
    measured = probe(LLAMA, prompt_tokens=_mean_prompt(LLAMA_MAX_PROMPT, LLAMA_MAX_OUTPUT))
    sim = measured.sim_params(LLAMA)
    scenarios, header = llama_plan(limits.duration_s, wanted, LLAMA, sim, args.starvation_s)
    sections = [llama_header(LLAMA, measured, sim, version), header]
    for scenario in scenarios:
        sections += asyncio.run(engine_sections(out, scenario, builder, sim,
                                                llama_engine(LLAMA), args.behaviours,
                                                args.targets, limits,
                                                twin=not args.no_sim_twin))
    return sections


def vllm_sections(out: Path, wanted: set[str], builder: PromptBuilder,
                  args: argparse.Namespace, limits: Limits) -> list[str]:
    """S1 / S2 on two vLLM CPU servers started once for the run (`VllmPool`)."""
    from tests.support.engines import vllm_python

    version = vllm_version(vllm_python())
    pool = VllmPool(VLLM)
    try:
        pool.ensure()
        measured = vllm_probe(pool, _mean_prompt(VLLM_MAX_PROMPT, VLLM_MAX_OUTPUT))
        sim = measured.sim_params(VLLM)
        scenarios, header = vllm_plan(limits.duration_s, wanted, sim, args.starvation_s)
        body: list[str] = []
        for scenario in scenarios:
            body += asyncio.run(engine_sections(out, scenario, builder, sim, pool.engine(),
                                                args.behaviours, args.targets, limits,
                                                twin=not args.no_sim_twin))
    finally:
        healthy, restarts = list(pool.healthy_after_s), pool.restarts
        pool.close()
    return [vllm_header(VLLM, measured, sim, version, healthy, restarts), header, *body]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    duration = args.duration if args.duration is not None else (8.0 if args.quick else 20.0)
    drain = args.drain if args.drain is not None else (6.0 if args.quick else 15.0)
    limits = Limits(duration_s=duration, drain_s=drain)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = set(args.scenarios)
    started = time.perf_counter()
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    params = SimParams()
    builder = PromptBuilder(load_counter(ROOT / "models" / "qwen3-14b"))
    if args.replicas < 1 or (args.replicas > 1 and args.engine != "sim"):
        raise SystemExit("--replicas: at least 1, and several only on the simulator")
    if args.engine == "llama.cpp":
        sections = llama_sections(out, wanted, builder, args, limits)
    elif args.engine == "vllm":
        sections = vllm_sections(out, wanted, builder, args, limits)
    else:
        scenarios, header = plan_scenarios(duration, params, wanted, args.s4_orderings,
                                           args.starvation_s, builder.group_overhead,
                                           args.prefix_calibration,
                                           user_overhead=builder.user_overhead,
                                           group_load=args.group_load)
        if args.orderings:
            scenarios = [s if s.key == "S4" else dataclasses.replace(s, orderings=args.orderings)
                         for s in scenarios]
        sections = [header]
        for scenario in scenarios:
            sections += asyncio.run(scenario_sections(out, scenario, builder, params,
                                                      args.behaviours, args.targets, limits,
                                                      args.retries, args.replicas))
    if "overhead" in wanted:
        sections.append(asyncio.run(overhead(args.overhead_scale)))
    elapsed = time.perf_counter() - started
    command = " ".join(["python -m benchmarks.run",
                        shlex.join(sys.argv[1:] if argv is None else list(argv))]).strip()
    report = ("# kvgate benchmark report\n\n"
              f"Command: `{command}`; {stamp}, {os.cpu_count()} CPUs, {_revision()}; "
              f"wall time {elapsed:.0f} s."
              "\n\n" + "\n\n".join(sections) + "\n")
    (out / "report.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
