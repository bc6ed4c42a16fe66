"""Figures from runs: goodput, percentiles, rejections, engine KV use; Markdown and PNG plots.

Percentiles are given twice, and labelled: over ALL offered requests, where a request
that was rejected, abandoned or not finished counts as infinitely late (a miss), and
over completed requests only. The first is what users feel; the second alone flatters
whoever turns most requests away.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.suite.cluster import Target
from benchmarks.suite.loadgen import Result, Run, Sample

INF = math.inf


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(value: float | None) -> str:
    if value is None:
        return "-"
    return "∞" if math.isinf(value) else f"{value * 1000:,.0f}"


def completed(r: Result) -> bool:
    """Answered 200 and streamed to its end (not rejected, abandoned, broken or cut)."""
    return r.ok and r.ttft_s is not None and r.latency_s is not None


@dataclass(frozen=True, slots=True)
class Summary:
    label: str
    offered: int
    completed: int
    goodput_per_s: float
    ttft_p50: float | None  # completed
    ttft_p99: float | None  # completed
    ttft_p99_all: float | None  # all offered, misses infinite
    queue_wait_p99: float | None  # completed; None without kvgate
    queue_wait_p99_all: float | None  # all offered, misses infinite; None without kvgate
    latency_p50: float | None
    latency_p99: float | None
    rejections: dict[str, int]  # kvgate's error codes, "abandoned", "cut_at_benchmark_end"
    preemptions: int
    kv_use_mean: float | None
    kv_use_saturated: float | None
    saturated_share: float
    peak_reserved: int | None
    worst_timeout_overshoot_s: float | None


def summarize(run: Run, *, slo_ttft_s: float, window_s: float,
              gated: bool) -> Summary:
    done = [r for r in run.results if completed(r)]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    ttft_all = ttft + [INF] * (len(run.results) - len(done))
    good = sum(1 for t in ttft if t <= slo_ttft_s)
    codes = Counter(r.code or f"http_{r.status}" for r in run.results if not completed(r))
    waits = [r.queue_wait_s if r.queue_wait_s is not None else 0.0 for r in done]
    waits_all = waits + [INF] * (len(run.results) - len(done))
    timeouts = [r.latency_s - r.from_first_s - r.deadline_s for r in run.results
                if r.code == "queue_timeout" and r.latency_s is not None
                and r.deadline_s is not None]
    samples = run.samples
    saturated = [s.kv_use for s in samples if s.saturated]
    reserved = [s.reserved for s in samples if s.reserved is not None]
    latency = [r.latency_s for r in done if r.latency_s is not None]
    return Summary(
        label=run.label,
        offered=len(run.results),
        completed=len(done),
        goodput_per_s=good / window_s,
        ttft_p50=pct(ttft, 0.50), ttft_p99=pct(ttft, 0.99), ttft_p99_all=pct(ttft_all, 0.99),
        queue_wait_p99=pct(waits, 0.99) if gated else None,
        queue_wait_p99_all=pct(waits_all, 0.99) if gated else None,
        latency_p50=pct(latency, 0.50), latency_p99=pct(latency, 0.99),
        rejections=dict(codes),
        preemptions=run.preemptions,
        kv_use_mean=statistics.mean(s.kv_use for s in samples) if samples else None,
        kv_use_saturated=statistics.mean(saturated) if saturated else None,
        saturated_share=len(saturated) / len(samples) if samples else 0.0,
        peak_reserved=max(reserved) if reserved else None,
        worst_timeout_overshoot_s=max(timeouts) if timeouts else None,
    )


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def table(summaries: list[Summary]) -> str:
    head = ("| target | completed / offered | goodput/s | not completed (reason: n) | "
            "preemptions | KV use mean / saturated (share of time saturated) | "
            "TTFT p99 all / completed ms | TTFT p50 completed ms | "
            "queue wait p99 all / completed ms | latency p50 / p99 completed ms | "
            "peak reserved |")
    lines = [head, "|" + "---|" * 11]
    for s in summaries:
        rejected = ", ".join(f"{k}: {v}" for k, v in sorted(s.rejections.items())) or "0"
        lines.append(
            f"| {s.label} | {s.completed} / {s.offered} | {s.goodput_per_s:.2f} | {rejected} | "
            f"{s.preemptions} | {_share(s.kv_use_mean)} / {_share(s.kv_use_saturated)} "
            f"({s.saturated_share:.0%}) | {ms(s.ttft_p99_all)} / {ms(s.ttft_p99)} | "
            f"{ms(s.ttft_p50)} | {ms(s.queue_wait_p99_all)} / {ms(s.queue_wait_p99)} | "
            f"{ms(s.latency_p50)} / {ms(s.latency_p99)} | "
            f"{'-' if s.peak_reserved is None else f'{s.peak_reserved:,}'} |"
        )
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class ClassSummary:
    kind: str
    offered: int
    completed: int
    ttft_p50: float | None
    ttft_p99: float | None
    ttft_p99_all: float | None
    outcomes: dict[str, int]


def by_class(results: Iterable[Result]) -> list[ClassSummary]:
    """Per request class (short / long in the head-of-line mix)."""
    kinds: dict[str, list[Result]] = {}
    for r in results:
        kinds.setdefault(r.spec.kind, []).append(r)
    out = []
    for kind, rs in sorted(kinds.items(), key=lambda kv: (kv[0] != "short", kv[0])):
        done = [r for r in rs if completed(r)]
        ttft = [r.ttft_s for r in done if r.ttft_s is not None]
        out.append(ClassSummary(
            kind=kind, offered=len(rs), completed=len(done),
            ttft_p50=pct(ttft, 0.5), ttft_p99=pct(ttft, 0.99),
            ttft_p99_all=pct(ttft + [INF] * (len(rs) - len(done)), 0.99),
            outcomes=dict(Counter(r.code or f"http_{r.status}"
                                  for r in rs if not completed(r)))))
    return out


def class_table(runs: list[Run]) -> str:
    lines = ["| target | class | completed / offered | TTFT p50 / p99 completed ms | "
             "TTFT p99 all ms | not completed (reason: n) |", "|---|---|---|---|---|---|"]
    for run in runs:
        for c in by_class(run.results):
            rest = ", ".join(f"{k}: {v}" for k, v in sorted(c.outcomes.items())) or "0"
            lines.append(f"| {run.label} | {c.kind} | {c.completed} / {c.offered} | "
                         f"{ms(c.ttft_p50)} / {ms(c.ttft_p99)} | {ms(c.ttft_p99_all)} | "
                         f"{rest} |")
    return "\n".join(lines)


def plot(runs: list[Run], title: str, path: Path) -> None:
    """TTFT CDF, engine KV use vs capacity, preemptions and waiting requests over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.4))
    cdf, kv, preempt, queue = axes
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        color = palette[i % len(palette)]  # one colour per target in every panel
        done = sorted(r.ttft_s for r in run.results if completed(r) and r.ttft_s is not None)
        if done:
            cdf.plot(done, [(i + 1) / len(run.results) for i in range(len(done))],
                     color=color, label=run.label)
        ts = [s.t for s in run.samples]
        kv.plot(ts, [s.kv_use for s in run.samples], color=color,
                label=f"{run.label}: engine KV use")
        if any(s.reserved is not None for s in run.samples):
            kv.plot(ts, [(s.reserved or 0) / s.capacity for s in run.samples], color=color,
                    linestyle="--", label=f"{run.label}: reserved")
        preempt.plot(ts, [s.preemptions for s in run.samples], color=color, label=run.label)
        queue.plot(ts, [s.engine_waiting + (s.queued or 0) for s in run.samples],
                   color=color, label=run.label)
    kv.axhline(1.0, color="black", linewidth=1, label="capacity")
    cdf.set(title="TTFT CDF (share of ALL offered requests)", xlabel="seconds",
            ylabel="share")
    kv.set(title="KV use (vllm:kv_cache_usage_perc) vs capacity", xlabel="seconds",
           ylabel="share of the pool", ylim=(0, 1.1))
    preempt.set(title="preemptions (cumulative)", xlabel="seconds", ylabel="preemptions")
    queue.set(title="requests waiting (engines + kvgate queue)", xlabel="seconds",
              ylabel="requests")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


IDLE_KV = 0.30  # a backend below this KV use is idle, for the Gz check
TURNED_AWAY = "cut_at_benchmark_end"  # not a rejection: still open at the hard stop


@dataclass(frozen=True, slots=True)
class PrefixSummary:
    """The shared-prefix scenarios' figures for one run."""

    label: str
    offered: int
    admitted: int  # answered 200 (the engine, or kvgate, took the request)
    completed: int
    goodput_per_s: float
    ttft_p50: float | None  # completed
    ttft_p99: float | None  # completed
    hit_tokens: float  # vllm:prefix_cache_hits_total, summed over the engines
    query_tokens: float  # vllm:prefix_cache_queries_total, summed
    kvgate_shared: float | None  # kvgate_shared_prefix_tokens_total, summed; None direct
    kv_saturated: float | None
    saturated_share: float
    kv_saturated_per_backend: tuple[float, ...]
    preemptions: int
    rejections: dict[str, int]  # every reason a request did not complete
    rejected_while_idle: int  # turned away while another backend was below IDLE_KV
    turned_away: int  # rejections less those cut at the hard stop

    @property
    def hit_rate(self) -> float | None:
        return self.hit_tokens / self.query_tokens if self.query_tokens else None

    @property
    def preempted_share(self) -> float:
        return self.preemptions / max(1, self.admitted)


def _nearest(samples: list[Sample], t: float) -> Sample | None:
    return min(samples, key=lambda s: abs(s.t - t)) if samples else None


def prefix_summary(run: Run, *, slo_ttft_s: float, window_s: float) -> PrefixSummary:
    """Goodput, TTFT, the engines' prefix hits, KV use at saturation (whole pool and per
    backend), preemptions, rejections; and how many requests were turned away (a kvgate
    error, or a client giving up) while some other backend's engine was below 30% KV use,
    at the sample nearest to the moment it was turned away."""
    done = [r for r in run.results if completed(r)]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    codes = Counter(r.code or f"http_{r.status}" for r in run.results if not completed(r))
    saturated = [s for s in run.samples if s.saturated]
    width = max((len(s.kv_per_backend) for s in run.samples), default=0)
    per_backend = tuple(statistics.mean(s.kv_per_backend[b] for s in saturated)
                        for b in range(width)) if saturated and width else ()
    gated = "kvgate_shared" in run.totals
    away = [r for r in run.results if not completed(r) and r.code != TURNED_AWAY]
    idle = 0
    for r in away:
        sample = _nearest(run.samples, r.sent_s - r.from_first_s + (r.latency_s or 0.0))
        if sample is None:
            continue
        others = [u for b, u in enumerate(sample.kv_per_backend) if gated or b != r.backend]
        idle += any(u < IDLE_KV for u in others)
    return PrefixSummary(
        label=run.label, offered=len(run.results),
        admitted=sum(1 for r in run.results if r.status == 200), completed=len(done),
        goodput_per_s=sum(1 for t in ttft if t <= slo_ttft_s) / window_s,
        ttft_p50=pct(ttft, 0.5), ttft_p99=pct(ttft, 0.99),
        hit_tokens=run.totals.get("prefix_hits", 0.0),
        query_tokens=run.totals.get("prefix_queries", 0.0),
        kvgate_shared=run.totals.get("kvgate_shared"),
        kv_saturated=statistics.mean(s.kv_use for s in saturated) if saturated else None,
        saturated_share=len(saturated) / len(run.samples) if run.samples else 0.0,
        kv_saturated_per_backend=per_backend, preemptions=run.preemptions,
        rejections=dict(codes), rejected_while_idle=idle, turned_away=len(away))


def prefix_table(summaries: list[PrefixSummary]) -> str:
    lines = ["| target | completed / offered | goodput/s | TTFT p50 / p99 completed ms | "
             "engine prefix hit rate (hit / query tokens) | kvgate shared-prefix tokens | "
             "KV use saturated (share of time) | per backend, saturated | preemptions "
             "(of admitted) | not completed (reason: n) | turned away while another "
             "backend < 30% KV |", "|" + "---|" * 11]
    for s in summaries:
        rest = ", ".join(f"{k}: {v}" for k, v in sorted(s.rejections.items())) or "0"
        rate = "-" if s.hit_rate is None else f"{s.hit_rate:.0%}"
        lines.append(
            f"| {s.label} | {s.completed} / {s.offered} | {s.goodput_per_s:.2f} | "
            f"{ms(s.ttft_p50)} / {ms(s.ttft_p99)} | {rate} ({s.hit_tokens:,.0f} / "
            f"{s.query_tokens:,.0f}) | "
            f"{'-' if s.kvgate_shared is None else f'{s.kvgate_shared:,.0f}'} | "
            f"{_share(s.kv_saturated)} ({s.saturated_share:.0%}) | "
            f"{' / '.join(f'{u:.0%}' for u in s.kv_saturated_per_backend) or '-'} | "
            f"{s.preemptions} ({s.preempted_share:.1%} of {s.admitted}) | {rest} | "
            f"{s.rejected_while_idle} of {s.turned_away} |")
    return "\n".join(lines)


# the targets' labels, as `summarize` names their runs
AWARE, BLIND = Target.ADAPTIVE.label, Target.ADAPTIVE_PREFIX_OFF.label
ONE_ENGINE = Target.ONE_ENGINE.label  # the hit-rate yardstick of M


def acceptance(key: str, summaries: list[PrefixSummary]) -> str:
    """The issue's targets for G, Gz and M, each stated as met or not, with its figures."""
    by = {s.label: s for s in summaries}
    aware = by.get(AWARE)
    if aware is None:
        return "Acceptance: not checked (no `kvgate adaptive` run)."
    checks: list[tuple[str, bool, str]] = []

    def ratio(other: str, need: float) -> None:
        o = by.get(other)
        if o is None:
            return
        r = aware.goodput_per_s / o.goodput_per_s if o.goodput_per_s else math.inf
        checks.append((f"goodput >= {need:g}x `{other}`", r >= need,
                       f"{aware.goodput_per_s:.2f} / {o.goodput_per_s:.2f} = {r:.2f}x"))

    if key == "G":
        ratio(BLIND, 2.0)
        ratio("direct+timeout", 1.5)
        ratio("affinity+timeout", 1.0)
        kv = aware.kv_saturated
        checks.append(("engine KV use at saturation >= 80%", kv is not None and kv >= 0.8,
                       f"{_share(kv)} ({aware.saturated_share:.0%} of the time saturated)"))
        checks.append(("preemptions <= 1% of admitted", aware.preempted_share <= 0.01,
                       f"{aware.preemptions} of {aware.admitted}"))
    elif key == "M":
        ratio(BLIND, 1.2)
        blind = by.get(BLIND)
        if blind is not None and blind.ttft_p50 and aware.ttft_p50 is not None:
            r = aware.ttft_p50 / blind.ttft_p50
            checks.append(("TTFT p50 of completed <= 0.7x prefix-blind", r <= 0.7,
                           f"{aware.ttft_p50 * 1000:,.0f} / {blind.ttft_p50 * 1000:,.0f} ms "
                           f"= {r:.2f}x"))
        one = by.get(ONE_ENGINE)
        if one is not None and one.hit_rate and aware.hit_rate is not None:
            r = aware.hit_rate / one.hit_rate
            checks.append((f"engine prefix hit rate >= 0.8x `{ONE_ENGINE}` (one engine "
                           "holding all the pools, same arrivals)", r >= 0.8,
                           f"{aware.hit_rate:.1%} / {one.hit_rate:.1%} = {r:.2f}x"))
    else:
        ratio("affinity+timeout", 1.2)
        checks.append(("no backend idle (< 30% KV use) while another rejects",
                       aware.rejected_while_idle == 0,
                       f"{aware.rejected_while_idle} of {aware.turned_away} turned away "
                       "while a backend was below 30%"))
    lines = [f"- {'MET' if ok else 'NOT MET'}: {what}: {figures}" for what, ok, figures in checks]
    return f"Acceptance ({key}, `kvgate adaptive` = prefix-aware):\n\n" + "\n".join(lines)


# Codes a request ends with when the engine (or the path to it) failed it: an engine's
# own error status (llama-server's codes are numbers), an error event mid-stream, an
# answer cut short of its length, kvgate's 502, a broken connection.
ENGINE_FAILURES = ("stream_error", "ended_early", "upstream_error", "internal_error")
GIVEN_UP = ("abandoned", "cut_at_benchmark_end")


def is_engine_failure(code: str) -> bool:
    return (code in ENGINE_FAILURES or code.isdigit() or code.startswith("client_error")
            or code.startswith("http_5"))


def outcome_split(rejections: dict[str, int]) -> tuple[int, int, int]:
    """(engine failures, kvgate refusals, abandoned or cut) from a summary's reasons."""
    failures = sum(n for c, n in rejections.items() if is_engine_failure(c))
    given_up = sum(n for c, n in rejections.items() if c in GIVEN_UP)
    return failures, sum(rejections.values()) - failures - given_up, given_up


def held_mean(run: Run) -> float | None:
    """Mean share of the pool the open streams hold, from the clients' side."""
    held = [s.client_held / s.capacity for s in run.samples if s.client_held is not None]
    return statistics.mean(held) if held else None


def engine_comparison(pairs: list[tuple[Summary, Run, Summary | None, Run | None]],
                      engine: str = "llama.cpp", engine_kv: bool = False) -> str:
    """Per target: a real engine next to the simulator fitted to it, on the same requests.
    `engine_kv` (vLLM): both report their own KV use and preemptions, compared as such;
    else (llama-server reports none) the clients' view of KV held is compared."""
    e = engine
    kv_head = (f"preemptions ({e} vs sim) | engine-reported KV use mean ({e} vs sim) | "
               f"KV held, clients' view, mean ({e} vs sim) |" if engine_kv else
               f"KV held, clients' view, mean ({e} vs sim) | sim engine-reported KV use "
               "mean |")
    lines = [f"| target | completed / offered ({e} vs sim) | goodput/s ({e} vs sim) "
             f"| goodput ratio {e} / sim | engine failures ({e} vs sim) | kvgate "
             f"refusals ({e} vs sim) | abandoned or cut ({e} vs sim) | " + kv_head,
             "|" + "---|" * (10 if engine_kv else 9)]
    for real, real_run, sim, sim_run in pairs:
        rf, rr, rg = outcome_split(real.rejections)
        if sim is None or sim_run is None:
            kv = (f"{real.preemptions} vs - | {_share(real.kv_use_mean)} vs - | "
                  f"{_share(held_mean(real_run))} vs - |" if engine_kv else
                  f"{_share(held_mean(real_run))} vs - | - |")
            lines.append(f"| {real.label} | {real.completed}/{real.offered} vs - | "
                         f"{real.goodput_per_s:.2f} vs - | - | {rf} vs - | {rr} vs - | "
                         f"{rg} vs - | " + kv)
            continue
        sf, sr, sg = outcome_split(sim.rejections)
        ratio = (f"{real.goodput_per_s / sim.goodput_per_s:.2f}x" if sim.goodput_per_s
                 else "-")
        held = f"{_share(held_mean(real_run))} vs {_share(held_mean(sim_run))}"
        kv = (f"{real.preemptions} vs {sim.preemptions} | {_share(real.kv_use_mean)} vs "
              f"{_share(sim.kv_use_mean)} | {held} |" if engine_kv else
              f"{held} | {_share(sim.kv_use_mean)} |")
        lines.append(
            f"| {real.label} | {real.completed}/{real.offered} vs {sim.completed}/"
            f"{sim.offered} | {real.goodput_per_s:.2f} vs {sim.goodput_per_s:.2f} | {ratio} | "
            f"{rf} vs {sf} | {rr} vs {sr} | {rg} vs {sg} | " + kv)
    return "\n".join(lines)
