"""What the suite's runs share, on the simulator and on real engines: a scenario, a run's
bounds, one run of one target on fresh processes (or on a real engine's servers), and
the sections that set a real engine's runs beside those of the simulator fitted to it.

A `RealEngine` names what differs between engines: how its servers and kvgate come up
(`cluster`), what every body carries, whether the model may end an answer itself before
the client does (vLLM's random weights sample their end-of-text token now and then;
the GGUF model's never do), and whether the engine reports its own KV use (vLLM's
`vllm:kv_cache_usage_perc`; llama-server reports none, and the clients' view stands in).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from benchmarks.suite.cluster import (
    AffinityRing,
    GateSettings,
    SimParams,
    StartFailed,
    Target,
    cluster,
)
from benchmarks.suite.loadgen import Run, run_open_loop
from benchmarks.suite.report import (
    Summary,
    _share,
    completed,
    engine_comparison,
    is_engine_failure,
    plot,
    summarize,
    table,
)
from benchmarks.suite.workloads import Behaviour, PromptBuilder, RequestSpec

SLO_TTFT_S = 3.0
DEADLINE_S = 3.0
DEFAULT_STARVATION_S = 5.0  # kvgate's default: above the deadline, so pure backfill
CLASSIC_TARGETS = (Target.DIRECT, Target.DIRECT_TIMEOUT, Target.STRICT, Target.ADAPTIVE)


@dataclass(frozen=True)
class RealEngine:
    """A real engine as the suite's backends."""

    name: str  # "llama.cpp", "vllm": in tables and file names
    what: str  # the servers, in prose: "llama-server", "vLLM"
    # (gate or None, backends) -> a context manager yielding a cluster-like object:
    # targets, sample, watch, samples, engine_totals (see cluster.Cluster)
    cluster: Callable[[GateSettings | None, int], contextlib.AbstractContextManager[Any]]
    body: dict[str, Any] = field(default_factory=dict)
    model_may_end: bool = False  # an answer ended "stop" before its length is completed
    engine_kv: bool = False  # the engine reports its own KV use


class PoolShape(Protocol):
    """What the simulator twin takes from an engine's pools."""

    @property
    def kv_tokens(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def max_num_seqs(self) -> int | None: ...


@dataclass(frozen=True, slots=True)
class Probe:
    """What the servers measured side by side, before the runs."""

    prompt_tokens: int
    output_tokens: int
    step_ms: dict[int, float]  # streams per server -> ms per token of one stream
    prefill_tokens_per_s: float
    wall_s: float

    def sim_params(self, params: PoolShape) -> SimParams:
        """The simulator fitted to the probe: step = a + b x running, the same pools and
        running-sequence limit (max_num_seqs), prefill at the measured rate, no prefix
        caching."""
        (n1, t1), (n2, t2) = sorted(self.step_ms.items())[:1] + sorted(self.step_ms.items())[-1:]
        per_seq = max(0.0, (t2 - t1) / (n2 - n1)) if n2 != n1 else 0.0
        base = max(0.1, t1 - per_seq * n1)
        return SimParams(kv_tokens=params.kv_tokens, decode_step_ms=round(base, 3),
                         per_seq_ms=round(per_seq, 3),
                         prefill_tokens_per_s=round(self.prefill_tokens_per_s),
                         max_model_len=params.max_model_len, max_num_seqs=params.max_num_seqs)


async def _probe_stream(s: aiohttp.ClientSession, url: str, body_extra: dict[str, Any],
                        prompt_words: int, output: int) -> tuple[float, float, int]:
    body = {**body_extra, "messages": [{"role": "user", "content": " the" * prompt_words}],
            "max_tokens": output, "stream": True}
    start = time.perf_counter()
    first = None
    chunks = 0
    async with s.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise StartFailed(f"probe: the engine answered {resp.status}")
        async for line in resp.content:
            if b'"delta":{"content":"' in line:
                chunks += 1
                if first is None:
                    first = time.perf_counter() - start
    end = time.perf_counter() - start
    return first or end, end, chunks


async def measure_streams(urls: list[str], body: dict[str, Any], *, prompt_tokens: int,
                          concurrency: Sequence[int] = (1, 3), output_tokens: int = 160,
                          fresh_connections: bool = False, rounds: int = 1) -> Probe:
    """All servers at once, `n` streams each for each n in `concurrency`: decode time per
    token of one stream at that load (median over the streams), and prefill rate from
    the single streams' first token. Warmed up first with a short request and one of the
    probe's prompt length per server (the first long prefill of a fresh server pays
    one-time costs). `rounds` > 1: every n is measured that many times, the medians over
    all of them (a shared machine's noise). `body` is merged into every probe request
    (vLLM's probe adds `ignore_eos` so that every stream runs its whole length: a
    probe, not traffic). Bounded: a few requests, 180 s."""
    started = time.perf_counter()
    per_n: dict[int, list[float]] = {n: [] for n in concurrency}
    prefill: list[float] = []
    connector = aiohttp.TCPConnector(force_close=fresh_connections)
    async with aiohttp.ClientSession(connector=connector) as s, asyncio.timeout(180):
        await asyncio.gather(*(_probe_stream(s, u, body, 32, 8) for u in urls))  # warm up
        if rounds > 1:
            await asyncio.gather(*(_probe_stream(s, u, body, prompt_tokens, 8) for u in urls))
        for _ in range(rounds):
            for n in concurrency:
                got = await asyncio.gather(*(_probe_stream(s, u, body, prompt_tokens,
                                                           output_tokens)
                                             for u in urls for _ in range(n)))
                per_n[n] += [(end - first) / max(1, chunks - 1) for first, end, chunks in got]
                if n == min(concurrency):
                    prefill += [prompt_tokens / first for first, _, _ in got]
    steps = {n: 1000 * statistics.median(v) for n, v in per_n.items()}
    return Probe(prompt_tokens=prompt_tokens, output_tokens=output_tokens, step_ms=steps,
                 prefill_tokens_per_s=statistics.median(prefill),
                 wall_s=time.perf_counter() - started)

@dataclass(frozen=True, slots=True)
class Scenario:
    key: str
    title: str
    specs: list[RequestSpec]
    orderings: tuple[str, ...] = ("fifo",)
    starvation_s: float = DEFAULT_STARVATION_S
    params: SimParams | None = None  # None: the suite's (prefix caching off)
    backends: int = 2
    targets: tuple[Target, ...] = CLASSIC_TARGETS  # when --targets is not given


@dataclass(frozen=True, slots=True)
class Limits:
    duration_s: float  # arrival window; goodput is per second of it
    drain_s: float  # after the window, before the hard stop

    @property
    def hard_stop_s(self) -> float:
        return self.duration_s + self.drain_s

async def run_target(key: str, specs: list[RequestSpec], builder: PromptBuilder,
                     params: SimParams, target: Target, behaviour: Behaviour,
                     ordering: str, label: str, limits: Limits, starvation_s: float,
                     backends: int = 2, engine: RealEngine | None = None,
                     retries: int = 0, replicas: int = 1) -> Run:
    """One run on fresh processes; raises StartFailed when the cluster does not come up.
    `engine` given: its servers instead of simulated backends.
    `retries`: a refused client retries once after its Retry-After (kvgate targets).
    `replicas`: kvgate targets run as that many replicas on one Redis ledger."""
    gate = None
    if target.proxy:
        gate = GateSettings(deadline_s=DEADLINE_S, ordering=ordering, starvation_s=starvation_s,
                            output_policy="fill", reservation=target.reservation,
                            prefix_sharing=target.prefix_sharing)
    route = None
    if target is Target.AFFINITY_TIMEOUT:
        route = AffinityRing(backends).backend
    real = engine is not None
    if target is Target.ONE_ENGINE:  # every pool in one engine
        params, backends = replace(params, kv_tokens=params.kv_tokens * backends), 1
    backends_cm = (engine.cluster(gate, backends) if engine is not None
                   else cluster(params, gate=gate, backends=backends, replicas=replicas))
    with backends_cm as c:
        run = await run_open_loop(
            c.targets, specs, builder, hard_stop_s=limits.hard_stop_s,
            deadline_s=DEADLINE_S if target.proxy else None,
            give_up_s=DEADLINE_S if target.gives_up else None, route=route,
            behaviour=behaviour, label=f"{key} {behaviour}: {label}", sampler=c.sample,
            watch=c.watch, hang_up_at_output=real, sim_fields=not real,
            body_extra=engine.body if engine is not None else None,
            fresh_connections=real, retries=retries if target.proxy else 0,
            model_may_end=engine is not None and engine.model_may_end)
        run.samples = c.samples
        run.totals = await c.engine_totals()
        run.preemptions = int(run.totals["preemptions"])
        if target.proxy and engine is None:
            run.totals |= await c.end_state()
            run.totals["replicas"] = float(max(1, len(c.replicas)))
    run.label = label
    return run

def runs_for(scenario: Scenario, targets: Sequence[Target]) -> list[tuple[Target, str, str]]:
    """(target, ordering, label): kvgate targets once per ordering the scenario compares."""
    out = []
    for target in targets:
        if not target.proxy:
            out.append((target, "fifo", target.label))
            continue
        for ordering in scenario.orderings:
            label = target.label if len(scenario.orderings) == 1 else (
                f"{target.label} {ordering}")
            out.append((target, ordering, label))
    return out


def end_state_note(run: Run) -> str | None:
    """What kvgate still held after the drain, for a run on several replicas (its
    acceptance asks for zero) or any run where something was left."""
    t = run.totals
    if "end_resident" not in t:
        return None
    left = {k: int(t.get(k, 0)) for k in ("end_resident", "end_leases", "end_inflight",
                                          "end_shared", "end_refs")}
    replicas = int(t.get("replicas", 1))
    if replicas <= 1 and not any(left.values()):
        return None
    return (f"{run.label}: after the drain, over {replicas} replica(s): "
            f"{left['end_resident']} resident tokens, {left['end_leases']} leases, "
            f"{left['end_inflight']} in flight, {left['end_shared']} tokens in shared blocks"
            + (f", {left['end_refs']} block keys referenced in Redis" if "end_refs" in t else "")
            + ("" if any(left.values()) else " (all released)"))


def notes_of(summaries: list[Summary], failed: list[str],
             runs: Sequence[Run] = ()) -> str:
    notes = [f"did not run: {f}" for f in failed]
    notes += [n for n in map(end_state_note, runs) if n is not None]
    for s in summaries:
        over = s.worst_timeout_overshoot_s
        if over is not None and over >= 0:
            notes.append(f"{s.label}: queue_timeout answered at most {over * 1000:.0f} ms "
                         f"past the {DEADLINE_S:.0f} s deadline")
        elif over is not None:  # every one refused as predicted late, before its deadline
            notes.append(f"{s.label}: every queue_timeout answered before the "
                         f"{DEADLINE_S:.0f} s deadline (the latest {-over * 1000:.0f} ms "
                         "before it)")
    return "\n".join(f"- {n}" for n in notes)

async def engine_sections(out: Path, scenario: Scenario, builder: PromptBuilder,
                          sim: SimParams, engine: RealEngine,
                          behaviours: Sequence[Behaviour], targets: Sequence[Target] | None,
                          limits: Limits, twin: bool = True) -> list[str]:
    """One scenario on the engine's servers, and (`twin`) on the simulator fitted to
    them, the same requests at the same times: both tables, plots and their comparison."""
    targets = scenario.targets if targets is None else targets
    real = engine.name
    sections = [f"## {scenario.key}: {scenario.title}\n\n{len(scenario.specs)} requests "
                f"arriving over {limits.duration_s:.0f} s; hard stop at "
                f"{limits.hard_stop_s:.0f} s; kvgate ordering fifo, starvation_s "
                f"{scenario.starvation_s:g} s."]
    gaps: list[tuple[Behaviour, Summary, Summary]] = []
    for behaviour in behaviours:
        print(f"{scenario.key} {behaviour}: {len(scenario.specs)} requests", file=sys.stderr,
              flush=True)
        by_engine: dict[str, list[Run]] = {real: [], "sim": []}
        failed: dict[str, list[str]] = {real: [], "sim": []}
        for target, ordering, label in runs_for(scenario, targets):
            for on in (real, "sim") if twin else (real,):
                try:
                    by_engine[on].append(await run_target(
                        scenario.key, scenario.specs, builder, sim, target, behaviour,
                        ordering, label, limits, scenario.starvation_s, scenario.backends,
                        engine=engine if on == real else None))
                except StartFailed as exc:
                    failed[on].append(f"{label}: {exc}")
        summaries = {e: [summarize(r, slo_ttft_s=SLO_TTFT_S, window_s=limits.duration_s,
                                   gated=r.label.startswith("kvgate")) for r in rs]
                     for e, rs in by_engine.items()}
        part = [f"### {scenario.key}, client behaviour `{behaviour}`"]
        sim_by = {s.label: (s, r) for s, r in zip(summaries["sim"], by_engine["sim"],
                                                  strict=True)}
        pairs = []
        for s_real, r_real in zip(summaries[real], by_engine[real], strict=True):
            s_sim, r_sim = sim_by.get(s_real.label, (None, None))
            pairs.append((s_real, r_real, s_sim, r_sim))
            if s_sim is not None:
                gaps.append((behaviour, s_real, s_sim))
        if pairs:
            part.append(f"{real} against the simulator fitted to it (same pools, slots, "
                        "step time and prefill rate; same requests):\n\n"
                        + engine_comparison(pairs, engine=real, engine_kv=engine.engine_kv))
        for on, what in ((real, engine.what), ("sim", "the fitted simulator")):
            if not (by_engine[on] or failed[on]):
                continue
            notes = notes_of(summaries[on], failed[on])
            text = f"On {what}:\n\n{table(summaries[on])}" if summaries[on] else \
                f"On {what}: no run."
            if on == real:
                dead = [r.label for r in by_engine[on]
                        if r.totals.get("engines_alive", 1.0) < 1.0]
                if dead:
                    notes += f"\n- a {engine.what} process died during: {', '.join(dead)}"
                notes += "".join(f"\n- {r.label}: {_failure_evidence(r)}"
                                 for r in by_engine[on] if _failure_evidence(r))
                if engine.model_may_end:
                    notes += "".join(f"\n- {r.label}: {_model_ends(r)}"
                                     for r in by_engine[on] if _model_ends(r))
            part.append(text + (f"\n\n{notes}" if notes else ""))
            if by_engine[on]:
                image = out / f"{scenario.key}-{behaviour}-{on}.png"
                plot(by_engine[on], f"{scenario.key}, `{behaviour}`, on {what}", image)
                part.append(f"![{scenario.key} {behaviour} {on}]({image.name})")
        sections.append("\n\n".join(part))
    if gaps:
        sections.append(_gap_section(scenario.key, gaps, real, engine.engine_kv))
    return sections


def _model_ends(run: Run) -> str:
    """How many answers the model ended itself ("stop") before their recorded length."""
    ended = [r for r in run.results if r.model_ended and completed(r)]
    if not ended:
        return ""
    short = sum(r.spec.output_tokens - r.tokens_out for r in ended)
    return (f"{len(ended)} answer{'s' if len(ended) > 1 else ''} ended by the model itself "
            f"(`finish_reason \"stop\"`) before the recorded length, {short:,} tokens short "
            "in all (counted as completed)")


def _failure_evidence(run: Run) -> str:
    """What the engine's failures said: each kind with its count and the stream's last
    line (or the error body's code) as the client read it."""
    seen: Counter[str] = Counter()
    for r in run.results:
        code = r.code or f"http_{r.status}"
        if completed(r) or not is_engine_failure(code):
            continue
        said = r.last_line.decode(errors="replace").strip()[:160] or f"status {r.status}"
        finish = f", finish_reason {r.finish}" if r.finish else ""
        seen[f"{code} (`{said}`{finish})"] += 1
    return "; ".join(f"{n} x {what}" for what, n in seen.most_common(3)) + (
        f"; {sum(seen.values()) - sum(n for _, n in seen.most_common(3))} more"
        if len(seen) > 3 else "")


def _gap_section(key: str, gaps: list[tuple[Behaviour, Summary, Summary]],
                 real: str = "llama.cpp", engine_kv: bool = False) -> str:
    """How far apart engine and simulator are: goodput ratio per cell, and whether the
    targets rank the same on both; `engine_kv`: with both engines' preemptions and
    reported KV use."""
    rows = []
    logs = []
    for behaviour, s_real, s_sim in gaps:
        ratio = s_real.goodput_per_s / s_sim.goodput_per_s if s_sim.goodput_per_s else None
        if ratio:
            logs.append(abs(math.log(ratio)))
        extra = (f" {s_real.preemptions} vs {s_sim.preemptions} | "
                 f"{_share(s_real.kv_use_mean)} vs {_share(s_sim.kv_use_mean)} |"
                 if engine_kv else "")
        rows.append(f"| {behaviour} | {s_real.label} | {s_real.goodput_per_s:.2f} | "
                    f"{s_sim.goodput_per_s:.2f} | "
                    f"{'-' if ratio is None else f'{ratio:.2f}x'} |" + extra)
    gaps_by = [(b, r.label, r.goodput_per_s, m.goodput_per_s) for b, r, m in gaps]
    ranks = []
    for behaviour in dict.fromkeys(b for b, *_ in gaps_by):
        cells = [(label, g_real, g_sim) for b, label, g_real, g_sim in gaps_by
                 if b == behaviour]
        by_real = [c[0] for c in sorted(cells, key=lambda c: -c[1])]
        by_sim = [c[0] for c in sorted(cells, key=lambda c: -c[2])]
        same = "the same order" if by_real == by_sim else "a different order"
        ranks.append(f"`{behaviour}`: {real} ranks {' > '.join(by_real)}; the simulator "
                     f"{' > '.join(by_sim)} ({same})")
    spread = (f"Geometric mean distance of the goodput ratio from 1: "
              f"{math.exp(statistics.mean(logs)):.2f}x over {len(logs)} cells with goodput "
              "on both. " if logs else "")
    head = (f"| behaviour | target | goodput/s {real} | goodput/s sim | {real} / sim |"
            + (f" preemptions {real} vs sim | engine-reported KV use mean {real} vs sim |"
               if engine_kv else ""))
    return (f"### {key}: how far apart {real} and the simulator are\n\n" + head + "\n"
            + "|---" * (7 if engine_kv else 5) + "|\n" + "\n".join(rows) + "\n\n" + spread
            + "Ranking by goodput: " + "; ".join(ranks) + ".")

