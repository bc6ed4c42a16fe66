"""The Grafana dashboard (deploy/grafana/kvgate.json) drawn from a real run, without Grafana.

    python -m benchmarks.render_dashboard [--duration 70] [--load 2.0] [--out docs/dashboard.png]

Starts two `kvgate sim` backends and one `kvgate serve` (reservation "adaptive") as fresh
processes on loopback, replays the Azure conversation trace at `--load` x the pool's
capacity with clients sending `max_tokens` 2048 (and the recorded length as
`sim_output_tokens`), and scrapes kvgate's and each backend's /metrics every
`--scrape-every` seconds into memory, as Prometheus would (`job` and `instance` labels
added). Every panel's PromQL is then evaluated over those series by
benchmarks/suite/promql.py, which supports exactly the forms the dashboard uses and fails
on anything else, and the panels are drawn in the dashboard's grid layout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import shlex
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.suite.cluster import GateSettings, SimParams, cluster
from benchmarks.suite.engine_run import DEADLINE_S
from benchmarks.suite.loadgen import run_open_loop
from benchmarks.suite.plan import MAX_OUTPUT, MAX_PROMPT, rate_for
from benchmarks.suite.promql import Labels, Query, Store, legend
from benchmarks.suite.workloads import Behaviour, PromptBuilder, load_azure, replay
from proxy.tokenize import TokenCounter, load_counter

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "kvgate.json"

# Grafana's dark theme and classic palette
BG, PANEL, BORDER, TEXT, MUTED, GRID = ("#111217", "#181b1f", "#2c3235", "#d8d9da",
                                        "#8e8e8e", "#2c3235")
PALETTE = ("#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9",
           "#fade2a", "#37872d", "#c4162a")


@dataclass(frozen=True, slots=True)
class Scrape:
    t: float
    job: str
    instance: str
    text: str


# --- the run ------------------------------------------------------------------------------

async def scrape_loop(targets: list[tuple[str, str]], every_s: float, out: list[Scrape],
                      stop: asyncio.Event) -> None:
    """Every `every_s`, each target's /metrics page with its scrape time (epoch seconds)."""
    timeout = aiohttp.ClientTimeout(total=max(0.5, every_s))
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while not stop.is_set():
            t = time.time()
            for job, url in targets:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(f"{url}/metrics") as resp:
                        text = await resp.text()
                    out.append(Scrape(t, job, urlsplit(url).netloc, text))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, t + every_s - time.time()))


def store_from(scrapes: list[Scrape]) -> Store:
    """The scraped pages as series, labelled with `job` and `instance` as Prometheus does."""
    store = Store()
    for s in sorted(scrapes, key=lambda s: s.t):
        for family in text_string_to_metric_families(s.text):
            for sample in family.samples:
                labels = {**sample.labels, "job": s.job, "instance": s.instance}
                store.add(sample.name, labels, s.t, float(sample.value))
    return store


@dataclass(frozen=True, slots=True)
class RunInfo:
    started: datetime.datetime
    duration_s: float
    load: float
    rate_per_s: float
    requests: int
    completed: int
    rejected: int
    kv_tokens: int
    sims: list[str]
    kvgate: str
    scrape_every_s: float


async def drive(duration_s: float, drain_s: float, load: float,
                scrape_every_s: float) -> tuple[Store, RunInfo]:
    params = SimParams()
    conv = load_azure("azure_llm_2023_conv_slice.csv")
    lengths = replay(conv, rate_per_s=1.0, duration_s=10**6, max_prompt=MAX_PROMPT,
                     max_output=MAX_OUTPUT)
    rate = load * rate_for(1.0, lengths, params)
    # The slice's first minute is sparse (the trace starts mid-stream): skip it, as the suite does.
    specs = replay(conv, rate_per_s=rate, duration_s=duration_s, max_prompt=MAX_PROMPT,
                   max_output=MAX_OUTPUT, start=300)
    counter = load_counter(ROOT / "models" / "qwen3-14b")
    assert isinstance(counter, TokenCounter)  # the bundled Qwen3 tokenizer.json
    builder = PromptBuilder(counter)
    gate = GateSettings(deadline_s=DEADLINE_S, output_policy="fill", reservation="adaptive")
    scrapes: list[Scrape] = []
    started = datetime.datetime.now(datetime.UTC)
    with cluster(params, gate=gate) as c:
        assert c.proxy is not None
        targets = [("kvgate", c.proxy)] + [("engines", url) for url in c.sims]
        stop = asyncio.Event()
        scraping = asyncio.create_task(scrape_loop(targets, scrape_every_s, scrapes, stop))
        await asyncio.sleep(2 * scrape_every_s)  # an idle baseline before the first request
        run = await run_open_loop(c.targets, specs, builder, hard_stop_s=duration_s + drain_s,
                                  deadline_s=DEADLINE_S, behaviour=Behaviour.CAP_2048,
                                  label=f"dashboard run {load}x")
        await asyncio.sleep(2 * scrape_every_s)
        stop.set()
        await scraping
    info = RunInfo(started=started, duration_s=duration_s, load=load, rate_per_s=rate,
                   requests=len(specs), completed=sum(r.ok for r in run.results),
                   rejected=sum(r.status not in (0, 200) for r in run.results),
                   kv_tokens=params.kv_tokens, sims=c.sims, kvgate=c.proxy,
                   scrape_every_s=scrape_every_s)
    return store_from(scrapes), info


# --- evaluation ---------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Series:
    name: str
    values: list[float]


def panel_series(panel: dict[str, Any], store: Store, times: list[float]) -> list[Series]:
    """Each target's result series, named by the target's legendFormat."""
    out = []
    for target in panel["targets"]:
        result = Query(target["expr"]).range(store, times)

        def key(item: tuple[Labels, list[float]]) -> list[tuple[str, str]]:
            return sorted(item[0])

        for labels, values in sorted(result.items(), key=key):
            fmt = target.get("legendFormat") or "{{__name__}}"
            out.append(Series(legend(fmt, labels).strip() or target["expr"], values))
    return out


def eval_times(store: Store, step_s: float) -> list[float]:
    ts = [t for times, _ in store.series.values() for t in times]
    start, end = min(ts), max(ts)
    n = int((end - start) / step_s) + 1
    return [start + i * step_s for i in range(n)]


# --- drawing ------------------------------------------------------------------------------

def fmt_value(value: float, unit: str) -> str:
    """A value as Grafana shows it for the panel's unit."""
    if math.isnan(value):
        return "No data"
    if unit == "percentunit":
        return f"{value * 100:.1f}%"
    if unit == "s":
        return f"{value * 1000:.0f} ms" if abs(value) < 1 else f"{value:.2f} s"
    if unit == "reqps":
        return f"{value:.2f} req/s"
    a = abs(value)
    if a >= 1e6:
        return f"{value / 1e6:.2f} Mil"
    if a >= 1e3:
        return f"{value / 1e3:.1f} K"
    return f"{value:.0f}" if value == int(value) else f"{value:.2f}"


def draw(dashboard: dict[str, Any], store: Store, times: list[float], footer: str,
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    from matplotlib.ticker import FuncFormatter, MultipleLocator

    panels = dashboard["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    col_in, row_in = 0.85, 0.42  # one grid column, one grid row (Grafana: 30 px rows)
    top_in, bottom_in = 0.7, 0.6
    width, height = 24 * col_in, rows * row_in + top_in + bottom_in
    fig = plt.figure(figsize=(width, height), facecolor=BG)
    fig.text(0.008, 1 - 0.35 / height, dashboard["title"], color=TEXT, fontsize=17,
             weight="bold", va="center")
    fig.text(0.992, 1 - 0.35 / height, "Grafana dashboard " + str(DASHBOARD.relative_to(ROOT))
             + ", drawn by benchmarks/render_dashboard.py", color=MUTED, fontsize=10,
             ha="right", va="center")
    fig.text(0.008, 0.25 / height, "\n".join(textwrap.wrap(footer, 240)), color=MUTED,
             fontsize=9.5, va="center", linespacing=1.5)
    span = times[-1] - times[0]
    tick_s = next((s for s in (5, 10, 15, 20, 30, 60, 120, 300) if span / s <= 8), 600)

    def clock(t: float, _pos: int | None = None) -> str:
        return f"{datetime.datetime.fromtimestamp(t, datetime.UTC):%H:%M:%S}"
    pad = 0.06  # inches between panels

    def rect(pos: dict[str, int], title_in: float) -> tuple[float, float, float, float]:
        left = (pos["x"] * col_in + pad) / width
        top = height - top_in - pos["y"] * row_in
        bottom = top - pos["h"] * row_in + pad
        return left, bottom / height, (pos["w"] * col_in - 2 * pad) / width, (
            (top - bottom - title_in) / height)

    for panel in panels:
        pos = panel["gridPos"]
        if panel["type"] == "row":
            left, bottom, w, h = rect(pos, 0.0)
            fig.text(left, bottom + h / 2, panel["title"], color=TEXT, fontsize=13,
                     weight="bold", va="center")
            continue
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        series = panel_series(panel, store, times)
        # the panel's box and title
        left, bottom, w, h = rect(pos, 0.0)
        fig.patches.append(Rectangle((left, bottom), w, h, transform=fig.transFigure,
                                         facecolor=PANEL, edgecolor=BORDER, zorder=-10))
        fig.text(left + 0.1 / width, bottom + h - 0.2 / height, panel["title"], color=TEXT,
                 fontsize=11, weight="bold", va="center")
        if panel["type"] == "stat":
            draw_stat(fig, (left, bottom, w, h - 0.4 / height), series, unit, times)
        elif panel["type"] == "timeseries":
            legend_rows = math.ceil(len(series) / (3 if pos["w"] >= 12 else 2))
            legend_in = 0.22 * max(1, legend_rows) + 0.1
            ax = fig.add_axes((left + 0.75 / width, bottom + (legend_in + 0.3) / height,
                               w - 0.95 / width, h - (legend_in + 0.3 + 0.45) / height))
            ax.set_facecolor(PANEL)
            for side in ax.spines.values():
                side.set_visible(False)
            ax.tick_params(colors=MUTED, labelsize=8.5, length=0)
            ax.grid(True, color=GRID, linewidth=0.6)
            ax.yaxis.set_major_formatter(FuncFormatter(
                lambda v, _pos, unit=unit: fmt_value(v, unit)))
            ax.xaxis.set_major_locator(MultipleLocator(tick_s))
            ax.xaxis.set_major_formatter(FuncFormatter(clock))
            ax.set_xlim(times[0], times[-1])
            drawn = [s for s in series if any(not math.isnan(v) for v in s.values)]
            for i, s in enumerate(drawn):
                ax.plot(times, s.values, color=PALETTE[i % len(PALETTE)], linewidth=1.4,
                        label=s.name)
            if drawn:
                ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]))
                ax.legend(loc="upper left", bbox_to_anchor=(-0.07, -0.12),
                          ncol=3 if pos["w"] >= 12 else 2, frameon=False, fontsize=8.5,
                          labelcolor=TEXT, handlelength=1.2, columnspacing=1.2)
            else:
                ax.set_yticks([])
                ax.text(0.5, 0.5, "No data", color=MUTED, fontsize=13, ha="center",
                        va="center", transform=ax.transAxes)
        else:
            raise ValueError(f"panel type {panel['type']!r} is not drawn")
    fig.savefig(path, dpi=100, facecolor=BG)
    plt.close(fig)


def draw_stat(fig: Any, box: tuple[float, float, float, float], series: list[Series],
              unit: str, times: list[float]) -> None:
    """Grafana's stat panel defaults: the last value of each series, large, with a sparkline
    of the series behind it."""
    left, bottom, w, h = box
    if not series:
        fig.text(left + w / 2, bottom + h / 2, "No data", color=MUTED, fontsize=14,
                 ha="center", va="center")
        return
    cell = w / len(series)
    for i, s in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        ax = fig.add_axes((left + i * cell + cell * 0.04, bottom + h * 0.04, cell * 0.92,
                           h * 0.45))
        ax.set_axis_off()
        ax.fill_between(times, [0 if math.isnan(v) else v for v in s.values], color=color,
                        alpha=0.18, linewidth=0)
        ax.plot(times, s.values, color=color, linewidth=1.0, alpha=0.7)
        last = next((v for v in reversed(s.values) if not math.isnan(v)), math.nan)
        fig.text(left + (i + 0.5) * cell, bottom + h * 0.62, fmt_value(last, unit),
                 color=color, fontsize=26, weight="bold", ha="center", va="center")
        fig.text(left + (i + 0.5) * cell, bottom + h * 0.88, s.name, color=TEXT, fontsize=10,
                 ha="center", va="center")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=70.0,
                    help="arrival window in seconds (default 70)")
    ap.add_argument("--drain", type=float, default=10.0,
                    help="seconds after the window before open requests are cut")
    ap.add_argument("--load", type=float, default=2.0,
                    help="offered load as a multiple of the pool's capacity (default 2.0)")
    ap.add_argument("--scrape-every", type=float, default=1.0,
                    help="seconds between scrapes, also the evaluation step (default 1)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    args = ap.parse_args(argv)
    if not 0 < args.duration <= 300 or not 0.2 <= args.scrape_every <= 5:
        ap.error("--duration must be in (0, 300] and --scrape-every in [0.2, 5]")
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:  # fail before the run on an unsupported expression
        for target in panel.get("targets", []):
            Query(target["expr"])
    store, info = asyncio.run(drive(args.duration, args.drain, args.load, args.scrape_every))
    times = eval_times(store, args.scrape_every)
    sims = ", ".join(f"sim-{i} = {urlsplit(u).netloc}" for i, u in enumerate(info.sims))
    command = "python -m benchmarks.render_dashboard " + shlex.join(sys.argv[1:] if argv is None
                                                                    else argv)
    footer = (
        f"Run {info.started:%Y-%m-%d %H:%M} UTC, `{command.strip()}`: kvgate serve "
        f"({urlsplit(info.kvgate).netloc}, reservation adaptive) in front of 2 kvgate sim "
        f"backends x {info.kv_tokens:,} KV tokens ({sims}); Azure conversation trace at "
        f"{info.load:g}x capacity ({info.rate_per_s:.2f} req/s, {info.requests} requests over "
        f"{info.duration_s:g} s; {info.completed} completed, {info.rejected} rejected), clients "
        f"send max_tokens 2048; /metrics scraped every {info.scrape_every_s:g} s.")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    draw(dashboard, store, times, footer, args.out)
    print(f"{args.out}: {info.requests} requests, {info.completed} completed, "
          f"{info.rejected} rejected, {len(times)} evaluation steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
