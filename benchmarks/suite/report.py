"""Figures from runs: goodput, percentiles, rejections, utilisation; Markdown and PNG plots."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from benchmarks.suite.loadgen import CUT, Run


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


@dataclass(frozen=True, slots=True)
class Summary:
    label: str
    offered: int
    completed: int
    goodput_per_s: float
    ttft_p50: float | None
    ttft_p95: float | None
    ttft_p99: float | None
    latency_p50: float | None
    latency_p95: float | None
    latency_p99: float | None
    rejections: dict[str, int]
    cut: int
    queue_wait_p99: float | None
    preemptions: int
    peak_resident: int
    capacity: int
    mean_utilisation: float
    peak_reserved: int | None
    worst_timeout_overshoot_s: float | None
    worst_queue_full_answer_s: float | None


def summarize(run: Run, *, slo_ttft_s: float, window_s: float) -> Summary:
    ok = [r for r in run.results if r.ok and r.ttft_s is not None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    latency = [r.latency_s for r in ok if r.latency_s is not None]
    good = sum(1 for t in ttft if t <= slo_ttft_s)
    codes = Counter(r.code for r in run.results if r.code and r.code != CUT)
    waits = [r.queue_wait_s for r in run.results if r.queue_wait_s is not None]
    timeouts = [r.latency_s - r.deadline_s for r in run.results
                if r.code == "queue_timeout" and r.latency_s is not None
                and r.deadline_s is not None]
    fulls = [r.latency_s for r in run.results if r.code == "queue_full" and r.latency_s]
    samples = run.samples
    capacity = samples[0].capacity if samples else 0
    reserved = [s.reserved for s in samples if s.reserved is not None]
    return Summary(
        label=run.label,
        offered=len(run.results),
        completed=len(ok),
        goodput_per_s=good / window_s,
        ttft_p50=pct(ttft, 0.50), ttft_p95=pct(ttft, 0.95), ttft_p99=pct(ttft, 0.99),
        latency_p50=pct(latency, 0.50), latency_p95=pct(latency, 0.95),
        latency_p99=pct(latency, 0.99),
        rejections=dict(codes),
        cut=sum(1 for r in run.results if r.code == CUT),
        queue_wait_p99=pct(waits, 0.99),
        preemptions=run.preemptions,
        peak_resident=max((s.resident for s in samples), default=0),
        capacity=capacity,
        mean_utilisation=(statistics.mean(s.resident for s in samples) / capacity
                          if samples and capacity else 0.0),
        peak_reserved=max(reserved) if reserved else None,
        worst_timeout_overshoot_s=max(timeouts) if timeouts else None,
        worst_queue_full_answer_s=max(fulls) if fulls else None,
    )


def table(summaries: list[Summary]) -> str:
    head = ("| run | offered | completed | goodput/s | TTFT p50/p95/p99 ms | "
            "latency p50/p95/p99 ms | rejected (reason: n) | cut | p99 queue wait ms | "
            "preemptions | peak resident / capacity | mean util |")
    lines = [head, "|" + "---|" * 12]
    for s in summaries:
        rejected = ", ".join(f"{k}: {v}" for k, v in sorted(s.rejections.items())) or "0"
        peak = f"{s.peak_resident:,} / {s.capacity:,}"
        if s.peak_reserved is not None:
            peak += f" (reserved {s.peak_reserved:,})"
        lines.append(
            f"| {s.label} | {s.offered} | {s.completed} | {s.goodput_per_s:.2f} | "
            f"{ms(s.ttft_p50)} / {ms(s.ttft_p95)} / {ms(s.ttft_p99)} | "
            f"{ms(s.latency_p50)} / {ms(s.latency_p95)} / {ms(s.latency_p99)} | {rejected} | "
            f"{s.cut} | {ms(s.queue_wait_p99)} | {s.preemptions} | {peak} | "
            f"{s.mean_utilisation:.0%} |"
        )
    return "\n".join(lines)


def plot(runs: list[Run], title: str, path: Path) -> None:
    """TTFT CDFs, resident tokens vs capacity, and queue depth over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    cdf, resident, queue = axes
    for run in runs:
        ttft = sorted(r.ttft_s for r in run.results if r.ok and r.ttft_s is not None)
        if ttft:
            ys = [(i + 1) / len(run.results) for i in range(len(ttft))]
            cdf.plot(ttft, ys, label=run.label)
        ts = [s.t for s in run.samples]
        resident.plot(ts, [s.resident for s in run.samples], label=f"{run.label}: in KV pools")
        if any(s.reserved is not None for s in run.samples):
            resident.plot(ts, [s.reserved or 0 for s in run.samples], linestyle="--",
                          label=f"{run.label}: reserved")
        queue.plot(ts, [s.queued for s in run.samples], label=run.label)
    if runs and runs[0].samples:
        resident.axhline(runs[0].samples[0].capacity, color="black", linewidth=1,
                         label="capacity")
    cdf.set(title="TTFT CDF (share of all requests)", xlabel="seconds", ylabel="share")
    resident.set(title="KV tokens resident vs capacity", xlabel="seconds", ylabel="tokens")
    queue.set(title="requests waiting", xlabel="seconds", ylabel="requests")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
