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
import datetime
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.suite.cluster import (
    AffinityRing,
    GateSettings,
    SimParams,
    StartFailed,
    Target,
    cluster,
)
from benchmarks.suite.llamacpp import LLAMA_BODY, LlamaParams, Probe, llama_cluster, probe
from benchmarks.suite.loadgen import RETRY_CAP_S, Run, run_closed_loop, run_open_loop
from benchmarks.suite.refusals import acceptance as deadline_acceptance
from benchmarks.suite.refusals import refusal_table, summarize_refusals, timeline
from benchmarks.suite.report import (
    Summary,
    acceptance,
    by_class,
    class_table,
    completed,
    engine_comparison,
    is_engine_failure,
    ms,
    pct,
    plot,
    prefix_summary,
    prefix_table,
    summarize,
    table,
)
from benchmarks.suite.workloads import (
    Behaviour,
    PromptBuilder,
    RequestSpec,
    TraceRow,
    burst,
    bursty_long_prompts,
    group_prompts,
    hol_mix,
    load_azure,
    replay,
    synthetic_mix,
)
from proxy.tokenize import load_counter

ROOT = Path(__file__).resolve().parent.parent
SLO_TTFT_S = 3.0
DEADLINE_S = 3.0
DEFAULT_STARVATION_S = 5.0  # kvgate's default: above the deadline, so pure backfill
HOL_STARVATION_S = 1.0  # below the deadline: a long waiter does reach the head's protection
MAX_PROMPT, MAX_OUTPUT = 6000, 1000
SCENARIOS = ("S1", "S2", "S2s", "S3", "S4", "B", "G", "Gz", "overhead")
BURSTY_MAX_OUTPUT = 200  # code completion: short answers
CLASSIC_TARGETS = (Target.DIRECT, Target.DIRECT_TIMEOUT, Target.STRICT, Target.ADAPTIVE)
PREFIX_TARGETS = (Target.DIRECT, Target.DIRECT_TIMEOUT, Target.AFFINITY_TIMEOUT,
                  Target.ADAPTIVE_PREFIX_OFF, Target.ADAPTIVE)
PREFIX_BACKENDS = 4
GROUPS, SYSTEM_TOKENS, QUESTION_TOKENS = 8, 2048, 256
ZIPF_S = 1.2  # Gz: the hot group takes 43% of the requests, the coldest 3.5%
ENGINES = ("sim", "llama.cpp")
# llama.cpp: two servers of 4,096-token unified pools, 4 slots each; the trace clipped
# so that its longest request fits a pool with room to spare and ~3 mean requests fill one
LLAMA = LlamaParams(ctx_size=4096, parallel=4)
LLAMA_MAX_PROMPT, LLAMA_MAX_OUTPUT = 2000, 500
LLAMA_SCENARIOS = ("S1", "S2")


def rate_for(load: float, specs: list[RequestSpec], params: SimParams,
             backends: int = 2) -> float:
    """Arrival rate at which offered resident tokens are `load` x the KV capacity.

    Little's law: resident = rate x service time x tokens per request. Service time is
    the output length times the step time at the concurrency the pool allows. Recorded
    lengths are used whatever the client behaviour: the load is what the requests really
    use, not what they announce. Every prompt token counts, shared or not: for the
    shared-prefix scenarios this is the footprint of a prefix-blind pool.
    """
    capacity: float = backends * params.kv_tokens
    per_request = statistics.mean(s.prompt_tokens + s.output_tokens for s in specs)
    running_per_backend = params.kv_tokens / per_request
    if params.max_num_seqs is not None:  # slots bound the concurrency before the pool
        running_per_backend = min(running_per_backend, params.max_num_seqs)
        capacity = backends * running_per_backend * per_request
    service_s = statistics.mean(s.output_tokens for s in specs) * params.step_s(
        running_per_backend)
    return load * capacity / (per_request * service_s)


def rate_for_shared(load: float, specs: list[RequestSpec], params: SimParams,
                    backends: int, groups: int) -> float:
    """`rate_for` on the footprint of a pool that holds each group's system prompt once:
    `groups / backends` prompts resident per backend, and per request only what follows
    the system prompt (its question, the template, its output). The ceiling of a perfect
    prefix-aware placement on a uniform group mix."""
    system = statistics.mean(s.system_tokens for s in specs)
    room = params.kv_tokens - groups / backends * system
    if room <= 0:
        raise ValueError("the groups' system prompts alone fill the pool")
    per_request = statistics.mean(s.prompt_tokens - s.system_tokens + s.output_tokens
                                  for s in specs)
    service_s = statistics.mean(s.output_tokens for s in specs) * params.step_s(
        room / per_request)
    return load * backends * room / (per_request * service_s)


def rescale(specs: list[RequestSpec], factor: float) -> list[RequestSpec]:
    return [replace(s, arrival_s=s.arrival_s / factor) for s in specs]


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
                     backends: int = 2, llama: LlamaParams | None = None,
                     retries: int = 0) -> Run:
    """One run on fresh processes; raises StartFailed when the cluster does not come up.
    `llama` given: llama-servers of those pools instead of simulated backends.
    `retries`: a refused client retries once after its Retry-After (kvgate targets)."""
    gate = None
    if target.proxy:
        gate = GateSettings(deadline_s=DEADLINE_S, ordering=ordering, starvation_s=starvation_s,
                            output_policy="fill", reservation=target.reservation,
                            prefix_sharing=target.prefix_sharing)
    route = None
    if target is Target.AFFINITY_TIMEOUT:
        route = AffinityRing(backends).backend
    real = llama is not None
    backends_cm = (llama_cluster(llama, gate=gate, backends=backends) if llama is not None
                   else cluster(params, gate=gate, backends=backends))
    with backends_cm as c:
        run = await run_open_loop(
            c.targets, specs, builder, hard_stop_s=limits.hard_stop_s,
            deadline_s=DEADLINE_S if target.proxy else None,
            give_up_s=DEADLINE_S if target.gives_up else None, route=route,
            behaviour=behaviour, label=f"{key} {behaviour}: {label}", sampler=c.sample,
            watch=c.watch, hang_up_at_output=real, sim_fields=not real,
            body_extra=LLAMA_BODY if real else None, fresh_connections=real,
            retries=retries if target.proxy else 0)
        run.samples = c.samples
        run.totals = await c.engine_totals()
        run.preemptions = int(run.totals["preemptions"])
    run.label = label
    return run


def plan_scenarios(duration_s: float, params: SimParams,
                   wanted: set[str], s4_orderings: tuple[str, ...],
                   starvation_s: float | None = None,
                   group_overhead: int = 13,
                   prefix_calibration: str = "shared", max_prompt: int = MAX_PROMPT,
                   max_output: int = MAX_OUTPUT) -> tuple[list[Scenario], str]:
    conv = load_azure("azure_llm_2023_conv_slice.csv")
    lengths = replay(conv, rate_per_s=1.0, duration_s=10**6, max_prompt=max_prompt,
                     max_output=max_output)
    one_x = rate_for(1.0, lengths, params)

    # The slice's first minute is sparse (the trace starts mid-stream): skip it.
    def conv_at(load: float, start: int = 300, span: float = duration_s) -> list[RequestSpec]:
        return replay(conv, rate_per_s=load * one_x, duration_s=span, max_prompt=max_prompt,
                      max_output=max_output, start=start)

    out: list[Scenario] = []
    if "S1" in wanted:
        out.append(Scenario("S1", "Under capacity (0.5x), Azure conversation trace",
                            conv_at(0.5)))
    if "S2" in wanted:
        out.append(Scenario("S2", "2x overload, Azure conversation trace", conv_at(2.0)))
    if "S2s" in wanted:
        synth = synthetic_mix(rate_per_s=1.0, duration_s=duration_s * 40, seed=3,
                              max_prompt=MAX_PROMPT, max_output=MAX_OUTPUT)
        synth = rescale(synth, 2.0 * rate_for(1.0, synth, params))
        out.append(Scenario("S2s", "2x overload, synthetic mix (lognormal, 2% very long)",
                            [s for s in synth if s.arrival_s < duration_s]))
    if "S3" in wanted:
        extra = [replace(s, arrival_s=s.arrival_s + 3.0)
                 for s in conv_at(5.0, start=1500, span=4.0)]
        out.append(Scenario(
            "S3", "5x burst for 4 s on a 0.5x base, then recovery, Azure conversation lengths",
            burst(conv_at(0.5), extra)))
    if "B" in wanted:
        out.append(_bursty(duration_s, params, max_prompt))
    if "S4" in wanted:
        hol = hol_mix(rate_per_s=1.0, duration_s=duration_s * 20, seed=11)
        hol = [s for s in rescale(hol, 1.5 * rate_for(1.0, hol, params))
               if s.arrival_s < duration_s]
        out.append(Scenario(
            "S4", "Mixed short and very long requests (1.5x), head-of-line blocking", hol,
            s4_orderings, HOL_STARVATION_S))
    prefix_header = ""
    if wanted & {"G", "Gz"}:
        shared, prefix_header = _group_scenarios(conv, duration_s, params, wanted,
                                                 group_overhead, prefix_calibration)
        out += shared
    if starvation_s is not None:
        out = [replace(s, starvation_s=starvation_s) for s in out]
    seqs = ("" if params.max_num_seqs is None
            else f"at most {params.max_num_seqs} running sequences each; ")
    header = (
        f"Pool: 2 simulated backends x {params.kv_tokens:,} KV tokens; {seqs}decode step "
        f"{params.decode_step_ms} ms + {params.per_seq_ms} ms per running sequence; prefill "
        f"{params.prefill_tokens_per_s:,.0f} tokens/s; max_model_len {params.max_model_len:,} "
        f"(kvgate and engines). 1x = {one_x:.2f} req/s on the Azure conversation lengths "
        f"(prompts clipped to {max_prompt}, outputs to {max_output}), calibrated at the "
        "recorded output lengths whatever the client sends. Every request carries "
        "`sim_output_tokens` = its recorded output length (the simulated EOS). "
        f"TTFT SLO for goodput: {SLO_TTFT_S} s. kvgate: queue deadline {DEADLINE_S} s, depth "
        "256, output_policy `fill`, starvation_s per scenario; `direct+timeout` clients "
        f"give up after {DEADLINE_S} s without a first token. Each run stops at the arrival "
        "window + drain; `cut_at_benchmark_end` counts requests still open then.")
    return out, header + prefix_header


def _bursty(duration_s: float, params: SimParams, max_prompt: int) -> Scenario:
    """B: code-completion shaped, long prompts and short answers in on-off bursts.

    1x is `rate_for` on a long draw of the same lengths; each on-phase arrives at 2x,
    each off-phase sends nothing; on and off phases each last 1 to 4 s (uniform), so
    the mean over the window is about 1x."""
    long = bursty_long_prompts(rate_per_s=1.0, duration_s=2000.0, seed=31,
                               max_prompt=max_prompt, max_output=BURSTY_MAX_OUTPUT)
    one_x = rate_for(1.0, long, params)
    specs = bursty_long_prompts(rate_per_s=2.0 * one_x, duration_s=duration_s, seed=32,
                                max_prompt=max_prompt, max_output=BURSTY_MAX_OUTPUT)
    prompts = statistics.mean(s.prompt_tokens for s in long)
    outputs = statistics.mean(s.output_tokens for s in long)
    title = (f"Bursty long prompts (code-completion shape): on-off bursts at 2x "
             f"({2 * one_x:.2f} req/s during a burst, {len(specs) / duration_s:.2f} req/s "
             f"over the window), prompts lognormal median 3,000 (mean {prompts:,.0f}, "
             f"clipped to {max_prompt:,}), answers lognormal median 60 (mean "
             f"{outputs:.0f}, 8 to {BURSTY_MAX_OUTPUT}), synthetic, seeded")
    return Scenario("B", title, specs)


def _group_scenarios(conv: list[TraceRow], duration_s: float, params: SimParams,
                     wanted: set[str], overhead: int,
                     calibration: str = "shared") -> tuple[list[Scenario], str]:
    """G and Gz: 8 groups sharing a system prompt each, 4 backends with prefix caching.

    2x is calibrated with Little's law (`calibration`):

    * "shared" (the default): on a pool that holds each group's system prompt once,
      2 per backend, and per request only its question, template and output
      (`rate_for_shared`): the ceiling of the best prefix-aware placement. 2x then
      overloads every target, the prefix-aware one included, so its KV use at
      saturation and its preemptions are measured under pressure, as in S2.
    * "unshared": on every request's whole prompt + output (`rate_for`, as S1-S4): 2x
      for a prefix-blind pool, but only about 0.55x of the prefix-aware ceiling, which
      then never saturates.

    One copy of each group's prompt per backend is degenerate at this scale: 8 x 2,048
    tokens fill a whole 16,384-token backend before any question.
    """
    sim = replace(params, prefix_caching=True)
    outputs = [max(1, min(r.output_tokens, MAX_OUTPUT)) for r in conv]

    def make(zipf_s: float, seed: int) -> list[RequestSpec]:
        def at(rate: float, span: float) -> list[RequestSpec]:
            return group_prompts(rate_per_s=rate, duration_s=span, seed=seed, outputs=outputs,
                                 prompt_overhead=overhead, groups=GROUPS,
                                 system_tokens=SYSTEM_TOKENS, question_tokens=QUESTION_TOKENS,
                                 zipf_s=zipf_s)
        # calibrate on a long draw of the same workload, then draw the window at 2x
        long = at(1.0, 2000.0)
        one_x = (rate_for(1.0, long, sim, PREFIX_BACKENDS) if calibration == "unshared"
                 else rate_for_shared(1.0, long, sim, PREFIX_BACKENDS, GROUPS))
        return at(2.0 * one_x, duration_s)

    out = []
    rates = []
    for key, zipf_s, seed, title in (
            ("G", 0.0, 21, "8 groups sharing a system prompt, uniform popularity, 2x"),
            ("Gz", ZIPF_S, 22, f"8 groups sharing a system prompt, Zipf s={ZIPF_S} "
                               "popularity (one hot group), 2x")):
        if key not in wanted:
            continue
        specs = make(zipf_s, seed)
        rates.append(f"{key} {len(specs) / duration_s:.2f} req/s offered")
        out.append(Scenario(key, title, specs, params=sim, backends=PREFIX_BACKENDS,
                            targets=PREFIX_TARGETS))
    prompt = SYSTEM_TOKENS + QUESTION_TOKENS + overhead
    mean_out = statistics.mean(outputs)
    blind = params.kv_tokens / (prompt + mean_out)
    aware = (params.kv_tokens - GROUPS // PREFIX_BACKENDS * SYSTEM_TOKENS) / (
        QUESTION_TOKENS + overhead + mean_out)
    load_blind = 2.0 if calibration == "unshared" else 2.0 * aware / blind
    load_aware = 2.0 if calibration == "shared" else 2.0 * blind / aware
    header = (
        f"\n\nShared-prefix scenarios (G, Gz): {PREFIX_BACKENDS} simulated backends x "
        f"{params.kv_tokens:,} KV tokens with vLLM v1 prefix caching ON (the Azure "
        f"scenarios keep it off); {GROUPS} groups, each a {SYSTEM_TOKENS:,}-token system "
        "prompt (distinct text per group, byte-identical within a group) and a "
        f"{QUESTION_TOKENS}-token question of its own ({prompt:,} tokens after the "
        f"template); output lengths drawn from the Azure conversation slice's recorded "
        f"outputs (clipped to {MAX_OUTPUT}, mean {mean_out:.0f}); Poisson arrivals. "
        + (f"2x is calibrated with Little's law on the shared footprint: a pool that "
           f"holds each group's system prompt once ({GROUPS // PREFIX_BACKENDS} per "
           "backend) and per request only its question, template and output, the ceiling "
           "of the best prefix-aware placement; 2x overloads every target, the "
           "prefix-aware one included, so that its KV use at saturation and preemptions "
           "are measured under pressure. "
           if calibration == "shared" else
           "2x is calibrated with Little's law on the unshared footprint (whole prompt + "
           "output per request, as in S1-S4): 2x for a prefix-blind pool. ")
        + f"({'; '.join(rates)}). At the mean lengths a backend holds {blind:.1f} requests "
        f"unshared, {aware:.1f} with {GROUPS // PREFIX_BACKENDS} groups' prompts held once "
        f"there: the offered load is {load_blind:.1f}x of a prefix-blind pool's capacity "
        f"and {load_aware:.2f}x of the prefix-aware ceiling. Calibrating on one copy of each "
        f"group's prompt per backend is degenerate here ({GROUPS} x {SYSTEM_TOKENS:,} "
        f"tokens fill a {params.kv_tokens:,}-token backend). `affinity+timeout`: clients "
        "hash the first 2,048 characters of the messages (role and content; here the "
        "system prompt's opening) onto a consistent-hash ring of the backends (64 "
        "points each, BLAKE2b), and give up at 3 s without a first token like "
        "`direct+timeout`. `kvgate adaptive` is `prefix_sharing = \"auto\"` (shared "
        "blocks charged once, placement follows the prefix); `kvgate adaptive-prefix-off` "
        "is `prefix_sharing = \"off\"` (every prompt charged in full, prefix-blind "
        "placement; the engines still cache prefixes).")
    return out, header


def _runs_for(scenario: Scenario, targets: Sequence[Target]) -> list[tuple[Target, str, str]]:
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


def _notes(summaries: list[Summary], failed: list[str]) -> str:
    notes = [f"did not run: {f}" for f in failed]
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
                            retries: int = 0) -> list[str]:
    """`targets` None: the scenario's own set. `retries`: every kvgate target runs
    twice, its clients not retrying and (label `+retry`) retrying once after a
    refusal's Retry-After."""
    params = scenario.params or params
    targets = scenario.targets if targets is None else targets
    prefix = scenario.key in ("G", "Gz")
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
        plan = [(t, o, label, 0) for t, o, label in _runs_for(scenario, targets)]
        if retries:
            plan += [(t, o, f"{label} +retry", retries) for t, o, label, _ in plan
                     if t.proxy]
        for target, ordering, label, tries in plan:
            try:
                runs.append(await run_target(scenario.key, scenario.specs, builder, params,
                                             target, behaviour, ordering, label, limits,
                                             scenario.starvation_s, scenario.backends,
                                             retries=tries))
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
                f"\n\n{_notes(summaries, failed)}")
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


async def engine_sections(out: Path, scenario: Scenario, builder: PromptBuilder,
                          sim: SimParams, llama: LlamaParams,
                          behaviours: Sequence[Behaviour], targets: Sequence[Target] | None,
                          limits: Limits, twin: bool = True) -> list[str]:
    """One scenario on llama-server, and (`twin`) on the simulator fitted to it, the
    same requests at the same times: both tables, plots and their comparison."""
    targets = scenario.targets if targets is None else targets
    sections = [f"## {scenario.key}: {scenario.title}\n\n{len(scenario.specs)} requests "
                f"arriving over {limits.duration_s:.0f} s; hard stop at "
                f"{limits.hard_stop_s:.0f} s; kvgate ordering fifo, starvation_s "
                f"{scenario.starvation_s:g} s."]
    gaps: list[tuple[Behaviour, str, float, float]] = []
    for behaviour in behaviours:
        print(f"{scenario.key} {behaviour}: {len(scenario.specs)} requests", file=sys.stderr,
              flush=True)
        by_engine: dict[str, list[Run]] = {"llama.cpp": [], "sim": []}
        failed: dict[str, list[str]] = {"llama.cpp": [], "sim": []}
        for target, ordering, label in _runs_for(scenario, targets):
            for engine in ("llama.cpp", "sim") if twin else ("llama.cpp",):
                try:
                    by_engine[engine].append(await run_target(
                        scenario.key, scenario.specs, builder, sim, target, behaviour,
                        ordering, label, limits, scenario.starvation_s, scenario.backends,
                        llama=llama if engine == "llama.cpp" else None))
                except StartFailed as exc:
                    failed[engine].append(f"{label}: {exc}")
        summaries = {e: [summarize(r, slo_ttft_s=SLO_TTFT_S, window_s=limits.duration_s,
                                   gated=r.label.startswith("kvgate")) for r in rs]
                     for e, rs in by_engine.items()}
        part = [f"### {scenario.key}, client behaviour `{behaviour}`"]
        sim_by = {s.label: (s, r) for s, r in zip(summaries["sim"], by_engine["sim"],
                                                  strict=True)}
        pairs = []
        for s_real, r_real in zip(summaries["llama.cpp"], by_engine["llama.cpp"],
                                  strict=True):
            s_sim, r_sim = sim_by.get(s_real.label, (None, None))
            pairs.append((s_real, r_real, s_sim, r_sim))
            if s_sim is not None:
                gaps.append((behaviour, s_real.label, s_real.goodput_per_s,
                             s_sim.goodput_per_s))
        if pairs:
            part.append("llama.cpp against the simulator fitted to it (same pools, slots, "
                        "step time and prefill rate; same requests):\n\n"
                        + engine_comparison(pairs))
        for engine, what in (("llama.cpp", "llama-server"),
                             ("sim", "the fitted simulator")):
            if not (by_engine[engine] or failed[engine]):
                continue
            notes = _notes(summaries[engine], failed[engine])
            text = f"On {what}:\n\n{table(summaries[engine])}" if summaries[engine] else \
                f"On {what}: no run."
            if engine == "llama.cpp":
                alive = [r.label for r in by_engine[engine]
                         if r.totals.get("engines_alive", 1.0) < 1.0]
                if alive:
                    notes += f"\n- a llama-server process died during: {', '.join(alive)}"
                notes += "".join(f"\n- {r.label}: {_failure_evidence(r)}"
                                 for r in by_engine[engine] if _failure_evidence(r))
            part.append(text + (f"\n\n{notes}" if notes else ""))
            if by_engine[engine]:
                image = out / f"{scenario.key}-{behaviour}-{engine}.png"
                plot(by_engine[engine], f"{scenario.key}, `{behaviour}`, on {what}", image)
                part.append(f"![{scenario.key} {behaviour} {engine}]({image.name})")
        sections.append("\n\n".join(part))
    if gaps:
        sections.append(_gap_section(scenario.key, gaps))
    return sections


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


def _gap_section(key: str, gaps: list[tuple[Behaviour, str, float, float]]) -> str:
    """How far apart engine and simulator are: goodput ratio per cell, and whether the
    targets rank the same on both."""
    rows = []
    logs = []
    for behaviour, label, real, sim in gaps:
        ratio = real / sim if sim else None
        if ratio:
            logs.append(abs(math.log(ratio)))
        rows.append(f"| {behaviour} | {label} | {real:.2f} | {sim:.2f} | "
                    f"{'-' if ratio is None else f'{ratio:.2f}x'} |")
    ranks = []
    for behaviour in dict.fromkeys(b for b, *_ in gaps):
        cells = [(label, real, sim) for b, label, real, sim in gaps if b == behaviour]
        by_real = [c[0] for c in sorted(cells, key=lambda c: -c[1])]
        by_sim = [c[0] for c in sorted(cells, key=lambda c: -c[2])]
        same = "the same order" if by_real == by_sim else "a different order"
        ranks.append(f"`{behaviour}`: llama.cpp ranks {' > '.join(by_real)}; the simulator "
                     f"{' > '.join(by_sim)} ({same})")
    spread = (f"Geometric mean distance of the goodput ratio from 1: "
              f"{math.exp(statistics.mean(logs)):.2f}x over {len(logs)} cells with goodput "
              "on both. " if logs else "")
    return (f"### {key}: how far apart llama.cpp and the simulator are\n\n"
            "| behaviour | target | goodput/s llama.cpp | goodput/s sim | llama.cpp / sim |\n"
            "|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n" + spread
            + "Ranking by goodput: " + "; ".join(ranks) + ".")


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
        help="direct, direct+timeout, strict, adaptive, affinity+timeout, adaptive-prefix-off "
             "(default: each scenario's own: S1-S4 the first four; G, Gz direct, "
             "direct+timeout, affinity+timeout, adaptive-prefix-off, adaptive)")
    parser.add_argument("--s4-orderings", default="fifo",
                        type=lambda v: tuple(_choices(v, ["fifo", "shortest-first", "priority"],
                                                      "unknown ordering")),
                        help="kvgate orderings compared in S4 (default: fifo)")
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
    parser.add_argument("--engine", choices=ENGINES, default="sim",
                        help="the backends: kvgate's simulator (default), or two llama.cpp "
                             "llama-servers (S1, S2 only; each cell also runs on the "
                             "simulator fitted to them unless --no-sim-twin)")
    parser.add_argument("--no-sim-twin", action="store_true",
                        help="--engine llama.cpp: skip the fitted simulator's runs")
    parser.add_argument("--quick", action="store_true",
                        help="short windows for development: numbers are noisier")
    parser.add_argument("--overhead-scale", type=float, default=1.0)
    parser.add_argument("--retries", type=int, choices=(0, 1), default=0,
                        help="1: each kvgate target also runs with clients that retry a "
                             "refusal once after its Retry-After (at most "
                             f"{RETRY_CAP_S:g} s), sending its ticket (simulator engine)")
    return parser.parse_args(argv)


def llama_plan(duration_s: float, wanted: set[str], llama: LlamaParams, sim: SimParams,
               starvation_s: float | None = None) -> tuple[list[Scenario], str]:
    """S1 / S2 for llama-server: the trace clipped to the small pools, calibrated on the
    simulator fitted to the servers (`Probe.sim_params`)."""
    bad = wanted - set(LLAMA_SCENARIOS)
    if bad:
        raise SystemExit(f"--engine llama.cpp runs {', '.join(LLAMA_SCENARIOS)} only; "
                         f"not {', '.join(sorted(bad))}")
    scenarios, header = plan_scenarios(duration_s, sim, wanted, ("fifo",), starvation_s,
                                       max_prompt=LLAMA_MAX_PROMPT,
                                       max_output=LLAMA_MAX_OUTPUT)
    header = header.replace("Pool: 2 simulated", "The simulator twin's pool: 2 simulated", 1)
    header = header.replace("Every request carries", "Every request to the simulator carries",
                            1)
    return scenarios, header


def llama_header(llama: LlamaParams, measured: Probe, sim: SimParams, version: str) -> str:
    steps = ", ".join(f"{n} stream{'s' if n > 1 else ''} each: {ms:.2f} ms"
                      for n, ms in sorted(measured.step_ms.items()))
    return (
        f"Engine: 2 llama.cpp `llama-server`s ({version}), the tiny random-weight Qwen3 "
        f"(real Qwen3 tokenizer and chat template), each `--ctx-size {llama.ctx_size} "
        f"--parallel {llama.parallel} --kv-unified --threads {llama.threads}`: one "
        f"{llama.ctx_size:,}-token KV pool per server shared by {llama.parallel} slots. "
        "kvgate in front: `kind = \"llama.cpp\"`, `slots = "
        f"{llama.parallel}`, `kv_tokens = max_model_len = {llama.ctx_size}`, `block_size = "
        "1`, `prefix_sharing = \"off\"`; the `adaptive` target is written as "
        "`reservation = \"adaptive\"` as it is for the simulator.\n\n"
        f"Measured before the runs, both servers at once ({measured.prompt_tokens}-word "
        f"prompts, {measured.output_tokens} tokens, {measured.wall_s:.0f} s): time per "
        f"token of one stream with {steps}; prefill about "
        f"{measured.prefill_tokens_per_s:,.0f} tokens/s (first token of the single streams). "
        f"The simulator twin is fitted to that: {sim.kv_tokens:,} KV tokens and at most "
        f"{sim.max_num_seqs} running sequences per backend, decode step "
        f"{sim.decode_step_ms} ms + {sim.per_seq_ms} ms per running sequence, prefill "
        f"{sim.prefill_tokens_per_s:,.0f} tokens/s, max_model_len {sim.max_model_len:,}, "
        "no prefix caching. Loads are calibrated as for the simulator (Little's law at the "
        "recorded lengths on the fitted step time), so 1x is the same rate for both.\n\n"
        "What differs from the simulator's runs: (1) the model never samples EOS, so each "
        "client closes its stream once it has read the request's recorded output length in "
        "content chunks (the model's end played by the client; llama-server stops the "
        "request when the connection goes, kvgate releases its lease on the disconnect); "
        "no body carries that length, neither as `max_tokens` nor as `sim_output_tokens` "
        "(the simulator's runs send `sim_output_tokens`, which only the simulator reads); "
        "a llama-server chunk can hold more than one token, so an answer may run a few "
        "tokens past its recorded length before the client hangs up; (2) bodies to "
        "llama-server carry `\"cache_prompt\": false`, `\"temperature\": 0` (greedy: the "
        "random model then never picks its end-of-generation token; sampled, it does now "
        "and then) and the model name `tiny-qwen3`; "
        "(3) llama.cpp preempts nothing: when a server's pool overflows its running "
        "requests fail (an error status, an error event mid-stream, or an answer that "
        "ends short of its length: all counted as engine failures), where the simulator "
        "preempts and recomputes as vLLM does; (4) llama-server reports no KV use, so the "
        "KV figures compared are the clients' view (prompt + tokens streamed so far over "
        "the open streams, as a share of both pools), taken the same way on both; "
        "(5) llama-server computes on the same 2 CPU cores as the clients, kvgate and "
        "whatever else runs on the machine, the simulator only sleeps.")


def llama_sections(out: Path, wanted: set[str], builder: PromptBuilder,
                   args: argparse.Namespace, limits: Limits) -> list[str]:
    from tests.support.engines import llama_server_binary

    lengths = replay(load_azure("azure_llm_2023_conv_slice.csv"), rate_per_s=1.0,
                     duration_s=10**6, max_prompt=LLAMA_MAX_PROMPT,
                     max_output=LLAMA_MAX_OUTPUT)
    version_file = llama_server_binary().parents[1] / "version.txt"
    version = (version_file.read_text().strip() if version_file.exists()
               else llama_server_binary().parent.parent.name)
    measured = probe(LLAMA, prompt_tokens=round(statistics.mean(
        s.prompt_tokens for s in lengths)))
    sim = measured.sim_params(LLAMA)
    scenarios, header = llama_plan(limits.duration_s, wanted, LLAMA, sim, args.starvation_s)
    sections = [llama_header(LLAMA, measured, sim, version), header]
    for scenario in scenarios:
        sections += asyncio.run(engine_sections(out, scenario, builder, sim, LLAMA,
                                                args.behaviours, args.targets, limits,
                                                twin=not args.no_sim_twin))
    return sections


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
    if args.engine == "llama.cpp":
        sections = llama_sections(out, wanted, builder, args, limits)
    else:
        scenarios, header = plan_scenarios(duration, params, wanted, args.s4_orderings,
                                           args.starvation_s, builder.group_overhead,
                                           args.prefix_calibration)
        sections = [header]
        for scenario in scenarios:
            sections += asyncio.run(scenario_sections(out, scenario, builder, params,
                                                      args.behaviours, args.targets, limits,
                                                      args.retries))
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
