"""What a refusal cost the client, what its retry got, and what capacity sat unused.

* Refusal latency: for every try a target refused itself (429 / 503: kvgate's queue
  full, deadline predicted or waited out, no backend), the time from the client's send
  of that try to the refusal, by reason. The reason is kvgate's code; `queue_timeout`
  is split by its message into `predicted` (refused before its deadline because the
  forecast says it cannot start in time: at arrival, or later while it waits) and
  `waited` (refused when the deadline passed in the queue).
* Retries (`run_open_loop(retries=1)`): of the refused requests that tried again after
  their Retry-After, how many were admitted (answered 200) on that try, and how many
  of those had their first token within the SLO counted from the FIRST try's send.
* Capacity left unused while requests waited: the integral over time of the KV the
  engines report free (1 - vllm:kv_cache_usage_perc, times each pool) while somebody
  waited (kvgate's queue for the model non-empty; for a direct target, an engine's own
  queue), in token-seconds, from the samples taken every 0.2 s; beside it, for kvgate,
  the part of its own admission target it had not reserved then.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

from benchmarks.suite.loadgen import CUT, RETRYABLE, Result, Run, Sample
from benchmarks.suite.report import completed, ms, pct

FAST_S = 0.050  # a refusal "at once": within 50 ms of the try's send


def refusal_reason(r: Result) -> str:
    code = r.code or f"http_{r.status}"
    if code == "queue_timeout":
        if "refused before it" in r.message:
            return "queue_timeout (predicted)"
        if "waited" in r.message:
            return "queue_timeout (waited)"
    return code


def tries(results: list[Result]) -> Iterator[Result]:
    """Every try sent: first tries and retries."""
    for r in results:
        if r.first is not None:
            yield r.first
            if r.sent_s > r.first.sent_s:
                yield r
        else:
            yield r


@dataclass(frozen=True, slots=True)
class Latencies:
    n: int
    fast_share: float | None  # share within FAST_S
    p50: float | None
    p99: float | None

    @classmethod
    def of(cls, values: list[float]) -> Latencies:
        fast = sum(1 for v in values if v <= FAST_S) / len(values) if values else None
        return cls(len(values), fast, pct(values, 0.5), pct(values, 0.99))


@dataclass(frozen=True, slots=True)
class RefusalSummary:
    label: str
    offered: int
    admitted: int  # requests answered 200 on some try
    first: Latencies  # refused first tries
    first_by_reason: dict[str, Latencies]
    retried: int  # refused requests whose retry was sent
    retry_admitted: int  # of those, answered 200 on the retry
    retry_good: int  # of those, first token within the SLO from the first try's send
    retry_refused: dict[str, int]  # retries refused again, by reason
    retry_cut: int  # refused requests still waiting to retry (or retrying) at the stop
    retry_wait_p50: float | None  # the waits the clients honoured
    retry_after_p50: float | None  # what the refused first tries were told to wait
    retry_after_max: float | None
    retried_latencies: Latencies  # refusals of retries, from the retry's send
    send_lag_p99: float | None  # client: scheduled arrival to send, all first tries
    waiting_s: float  # time somebody waited (kvgate's queue, or an engine's when direct)
    unused_token_s: float  # engine-reported free KV x time while somebody waited
    unreserved_token_s: float | None  # kvgate: (admission target - reserved) x that time
    capacity: int
    ttft_admitted_p99: float | None  # completed, from the first try's send
    engine_ttft_p99: float | None  # completed: TTFT less kvgate's queue wait, own try
    preemptions: int

    @property
    def retry_rate(self) -> float | None:
        return self.retry_admitted / self.retried if self.retried else None

    @property
    def unused_share(self) -> float | None:
        """Unused token-seconds over the capacity's token-seconds while somebody waited."""
        if not self.waiting_s or not self.capacity:
            return None
        return self.unused_token_s / (self.capacity * self.waiting_s)


def _waiting(s: Sample) -> bool:
    return bool(s.queued) if s.queued is not None else s.engine_waiting > 0


def unused_capacity(samples: list[Sample]) -> tuple[float, float, float | None]:
    """(seconds somebody waited, engine-free token-seconds then, kvgate-unreserved
    token-seconds then or None when direct): left Riemann sums over the samples."""
    ordered = sorted(samples, key=lambda s: s.t)
    waited = unused = 0.0
    unreserved: float | None = None
    for a, b in pairwise(ordered):
        if not _waiting(a):
            continue
        dt = b.t - a.t
        waited += dt
        unused += max(0.0, 1.0 - a.kv_use) * a.capacity * dt
        if a.target_per_backend:
            free = sum(max(0, t - r) for t, r in zip(a.target_per_backend,
                                                     a.reserved_per_backend, strict=False))
            unreserved = (unreserved or 0.0) + free * dt
    return waited, unused, unreserved


def summarize_refusals(run: Run, *, slo_ttft_s: float) -> RefusalSummary:
    firsts = [r.first or r for r in run.results]
    refused = [t for t in firsts if t.status in RETRYABLE and t.refusal_s is not None]
    reasons: dict[str, list[float]] = {}
    for t in refused:
        reasons.setdefault(refusal_reason(t), []).append(t.refusal_s or 0.0)
    retried = [r for r in run.results if r.first is not None and r.sent_s > r.first.sent_s]
    admitted = [r for r in retried if r.status == 200]
    again = [r for r in retried if r.status in RETRYABLE]
    refused_again: dict[str, int] = {}
    for r in again:
        refused_again[refusal_reason(r)] = refused_again.get(refusal_reason(r), 0) + 1
    cut = sum(1 for r in run.results if r.first is not None and r.code == CUT)
    waits = [r.retry_wait_s for r in run.results if r.retry_wait_s is not None]
    told = [t.retry_after_s for t in refused if t.retry_after_s is not None]
    lag = [t.sent_s - t.spec.arrival_s for t in firsts if t.status != 0]
    waited_s, unused, unreserved = unused_capacity(run.samples)
    done = [r for r in run.results if completed(r) and r.ttft_s is not None]
    engine_side = [(r.ttft_s or 0.0) - r.from_first_s - (r.queue_wait_s or 0.0)
                   for r in done]
    return RefusalSummary(
        label=run.label, offered=len(run.results),
        admitted=sum(1 for r in run.results if r.status == 200),
        first=Latencies.of([t.refusal_s or 0.0 for t in refused]),
        first_by_reason={k: Latencies.of(v) for k, v in sorted(reasons.items())},
        retried=len(retried), retry_admitted=len(admitted),
        retry_good=sum(1 for r in admitted if completed(r) and r.ttft_s is not None
                       and r.ttft_s <= slo_ttft_s),
        retry_refused=refused_again, retry_cut=cut,
        retry_wait_p50=pct(waits, 0.5),
        retry_after_p50=pct(told, 0.5), retry_after_max=max(told, default=None),
        retried_latencies=Latencies.of([r.refusal_s or 0.0 for r in again]),
        send_lag_p99=pct(lag, 0.99), waiting_s=waited_s, unused_token_s=unused,
        unreserved_token_s=unreserved,
        capacity=run.samples[0].capacity if run.samples else 0,
        ttft_admitted_p99=pct([r.ttft_s or 0.0 for r in done], 0.99),
        engine_ttft_p99=pct(engine_side, 0.99), preemptions=run.preemptions)


def _share(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def refusal_table(summaries: list[RefusalSummary]) -> str:
    """Refusal latency by reason, retries, unused capacity; one row per target."""
    lines = ["| target | refused on first try | within 50 ms | refusal p50 / p99 ms | "
             "by reason: n (within 50 ms, p50 / p99 ms) | Retry-After p50 / max ms | "
             "retried (wait p50 ms) | admitted on the retry "
             "(rate) | of those within SLO from first send | retries refused again | "
             "KV free while requests waited: token-s (share of pool; time waited) | "
             "kvgate target unreserved then, token-s | client send lag p99 ms |",
             "|" + "---|" * 13]
    for s in summaries:
        reasons = "; ".join(f"{k}: {v.n} ({_share(v.fast_share)}, {ms(v.p50)} / {ms(v.p99)})"
                            for k, v in s.first_by_reason.items()) or "-"
        again = ", ".join(f"{k}: {n}" for k, n in sorted(s.retry_refused.items())) or "0"
        retry = ("-" if not s.retried else
                 f"{s.retry_admitted} ({_share(s.retry_rate)})")
        unreserved = ("-" if s.unreserved_token_s is None
                      else f"{s.unreserved_token_s:,.0f}")
        cut = f"; {s.retry_cut} cut waiting" if s.retry_cut else ""
        lines.append(
            f"| {s.label} | {s.first.n} of {s.offered} | {_share(s.first.fast_share)} | "
            f"{ms(s.first.p50)} / {ms(s.first.p99)} | {reasons} | "
            f"{ms(s.retry_after_p50)} / {ms(s.retry_after_max)} | {s.retried}{cut}"
            f"{f' ({ms(s.retry_wait_p50)})' if s.retried else ''} | "
            f"{retry} | {s.retry_good if s.retried else '-'} | "
            f"{again if s.retried else '-'} | {s.unused_token_s:,.0f} "
            f"({_share(s.unused_share)}; {s.waiting_s:.1f} s) | {unreserved} | "
            f"{ms(s.send_lag_p99)} |")
    return "\n".join(lines)


def timeline(runs: list[Run], title: str, path: Path) -> None:
    """Admission timeline, one row per run: per backend the engine-reported KV use,
    kvgate's reserved tokens and admission target, kvgate's queue depth; and per
    request its arrival, refusal (by reason), first token and end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 2, figsize=(18, 3.2 * len(runs)), squeeze=False)
    marks = {"queue_timeout (predicted)": ("x", "tab:red"),
             "queue_timeout (waited)": ("v", "tab:purple"),
             "queue_full": ("s", "tab:brown")}
    for row, run in zip(axes, runs, strict=True):
        pool, reqs = row
        ts = [s.t for s in run.samples]
        width = max((len(s.kv_per_backend) for s in run.samples), default=0)
        per_pool = run.samples[0].capacity / max(1, width) if run.samples else 1
        palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for b in range(width):
            color = palette[b % len(palette)]  # one colour per backend
            pool.plot(ts, [s.kv_per_backend[b] if b < len(s.kv_per_backend) else 0
                           for s in run.samples], color=color,
                      label=f"backend {b}: engine KV use")
            if any(s.reserved_per_backend for s in run.samples):
                pool.plot(ts, [s.reserved_per_backend[b] / per_pool
                               if b < len(s.reserved_per_backend) else 0
                               for s in run.samples], linestyle="--", color=color,
                          label=f"backend {b}: kvgate reserved")
                pool.plot(ts, [s.target_per_backend[b] / per_pool
                               if b < len(s.target_per_backend) else 0
                               for s in run.samples], linestyle=":", color=color,
                          label=f"backend {b}: admission target")
        depth = pool.twinx()
        depth.plot(ts, [s.queued if s.queued is not None else s.engine_waiting
                        for s in run.samples], color="black", linewidth=0.8,
                   label="waiting (kvgate queue; engines' when direct)")
        depth.set_ylabel("requests waiting")
        waiting = [s for s in run.samples if _waiting(s)]
        for s in waiting:  # shade the time somebody waited
            pool.axvspan(s.t, s.t + 0.2, color="orange", alpha=0.08, linewidth=0)
        pool.set(title=f"{run.label}: pool (shaded: somebody waiting)", xlabel="seconds",
                 ylabel="share of a backend", ylim=(0, 1.1))
        pool.legend(fontsize=6, loc="upper left")
        depth.legend(fontsize=6, loc="upper right")
        arrivals = [t.sent_s for r in run.results for t in [r.first or r]]
        reqs.scatter(arrivals, range(len(arrivals)), s=2, color="grey", label="arrival")
        for reason, (marker, color) in marks.items():
            pts = [(t.sent_s + (t.refusal_s or 0.0), i) for i, r in enumerate(run.results)
                   for t in tries([r]) if t.status in RETRYABLE and refusal_reason(t) == reason]
            if pts:
                reqs.scatter(*zip(*pts, strict=True), s=8, marker=marker, color=color,
                             label=f"refused: {reason}")
        firsts = [(r.sent_s - r.from_first_s + (r.ttft_s or 0.0), i)
                  for i, r in enumerate(run.results) if completed(r)]
        ends = [(r.sent_s - r.from_first_s + (r.latency_s or 0.0), i)
                for i, r in enumerate(run.results) if completed(r)]
        if firsts:
            reqs.scatter(*zip(*firsts, strict=True), s=2, color="tab:green",
                         label="first token")
            reqs.scatter(*zip(*ends, strict=True), s=2, color="tab:blue", label="end")
        reqs.set(title=f"{run.label}: requests", xlabel="seconds", ylabel="request")
        reqs.legend(fontsize=6, markerscale=3)
        for ax in row:
            ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)


def acceptance(key: str, goodput: dict[str, float], refusals: dict[str, RefusalSummary],
               deadline_s: float) -> str:
    """Issue #22's targets for one scenario and client behaviour, each met or not.

    `goodput` and `refusals` by target label; the kvgate target judged is `kvgate
    adaptive` (its retrying client `kvgate adaptive +retry` for the retry rate)."""
    lines = []
    best_direct = max((goodput.get(k, 0.0) for k in ("direct", "direct+timeout")),
                      default=0.0)
    for label in ("kvgate adaptive", "kvgate adaptive +retry"):
        if label not in refusals:
            continue
        s, g = refusals[label], goodput.get(label, 0.0)
        checks: list[tuple[str, bool, str]] = []
        if s.first.n:
            fast = s.first.fast_share or 0.0
            checks.append(("refusals >= 90% answered within 50 ms", fast >= 0.9,
                           f"{fast:.0%} of {s.first.n}, p50 / p99 {ms(s.first.p50)} / "
                           f"{ms(s.first.p99)} ms"))
        else:
            checks.append(("refusals >= 90% answered within 50 ms", True, "no refusal"))
        if s.retried and key == "S2":
            rate = s.retry_rate or 0.0
            checks.append(("a retry after Retry-After admitted >= 60%", rate >= 0.6,
                           f"{s.retry_admitted} of {s.retried} = {rate:.0%}"))
        if best_direct:
            r = g / best_direct
            checks.append(("goodput >= 1.0x the better of direct, direct+timeout", r >= 1.0,
                           f"{g:.2f} / {best_direct:.2f} = {r:.2f}x"))
        dt = goodput.get("direct+timeout")
        if key == "S2" and dt:
            checks.append(("goodput >= 1.1x direct+timeout", g / dt >= 1.1,
                           f"{g:.2f} / {dt:.2f} = {g / dt:.2f}x"))
        share = s.preemptions / max(1, s.admitted)
        checks.append(("preemptions <= 1% of admitted", share <= 0.01,
                       f"{s.preemptions} of {s.admitted} ({share:.1%})"))
        if s.ttft_admitted_p99 is not None:
            bound = deadline_s + (s.engine_ttft_p99 or 0.0)
            checks.append(("p99 TTFT of admitted within deadline + service time",
                           s.ttft_admitted_p99 <= bound,
                           f"{ms(s.ttft_admitted_p99)} ms <= {deadline_s:g} s + "
                           f"{ms(s.engine_ttft_p99)} ms"))
        lines.append(f"`{label}`:\n\n" + "\n".join(
            f"- {'MET' if ok else 'NOT MET'}: {what}: {figures}"
            for what, ok, figures in checks))
    return "\n\n".join(lines)
