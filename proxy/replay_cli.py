"""`kvgate simulate`: argument parsing, deployment resolution and the text report.

Kept apart from proxy/cli.py so the simulator's many flags do not crowd it; cli.py
only registers `add_simulate`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from policies.engines import PrefixSharing
from policies.output import OutputPolicy, OutputPolicyName
from policies.reservation import ReservationMode
from proxy.config import QueueConfig, load_config
from proxy.plan_cli import CliError, build_plan
from proxy.replay import EngineSpeed, Scenario, SimReport, load_trace, simulate

__all__ = ["Slo", "add_simulate", "build_scenario", "parse_slo", "parse_sweep", "run_simulate"]

_SPEED = EngineSpeed()  # slotted dataclasses: defaults are read from an instance
_QUEUE = QueueConfig()


def _capacity_from_flags(args: argparse.Namespace) -> tuple[int, int]:
    """(tokens per backend, block size) from `kvgate plan`'s own flags and code."""
    if args.kv_tokens is not None:
        return args.kv_tokens, args.block_size
    if args.usable_memory is None:
        raise CliError("give --config, --kv-tokens, or --model-config (or --layers/--kv-heads/"
                       "--head-dim) with --usable-memory and --params or --weights-bytes")
    plan_args = argparse.Namespace(**vars(args))
    plan_args.tokens, plan_args.concurrency = "1", 1
    result = build_plan(plan_args)
    return result.token_capacity, result.block_size


def build_scenario(args: argparse.Namespace) -> Scenario:
    """The candidate deployment: a kvgate config file, or the flags `kvgate plan` takes."""
    speed = EngineSpeed(decode_step_ms=args.decode_step_ms, per_seq_ms=args.per_seq_ms,
                        prefill_tokens_per_s=args.prefill_tokens_per_s,
                        max_num_seqs=args.max_num_seqs)
    common: dict[str, Any] = {"speed": speed, "client": args.client,
                              "ttft_slo_s": args.ttft_slo, "sample_interval_s": args.sample_s,
                              "prefix_caching": not args.no_prefix_caching,
                              "retries": args.retries, "tickets": not args.no_tickets}
    if args.config:
        config = load_config(args.config)
        models = {m.name: m for m in config.models}
        if args.model and args.model not in models:
            raise ValueError(f"--model {args.model!r} is not in {args.config}: {sorted(models)}")
        model = models[args.model] if args.model else config.models[0]
        deployment = model.deployment
        scenario = Scenario(
            capacity_tokens=args.kv_tokens or model.capacity_tokens,
            backends=args.backends or len(model.backends), block_size=model.block_size,
            max_model_len=args.max_model_len or model.max_model_len, queue=config.queue,
            reservation=ReservationMode(args.reservation or model.reservation),
            adaptive=model.adaptive, output=model.output, placement=model.placement,
            deployment=deployment,
            prefix_sharing=PrefixSharing(args.prefix_sharing or model.prefix_sharing), **common)
    else:
        capacity, block = _capacity_from_flags(args)
        queue = QueueConfig(max_depth=args.max_queue_depth, default_deadline_s=args.deadline,
                            max_deadline_s=max(args.deadline, _QUEUE.max_deadline_s))
        scenario = Scenario(
            capacity_tokens=capacity, backends=args.backends or 1, block_size=block,
            max_model_len=args.max_model_len or 8192, queue=queue,
            reservation=ReservationMode(args.reservation or "adaptive"),
            output=OutputPolicy(name=OutputPolicyName.FILL),
            prefix_sharing=PrefixSharing(args.prefix_sharing or "auto"), **common)
    if args.config and (args.deadline_given or args.depth_given):
        scenario = replace(scenario, queue=replace(
            scenario.queue,
            default_deadline_s=args.deadline if args.deadline_given
            else scenario.queue.default_deadline_s,
            max_deadline_s=max(args.deadline, scenario.queue.max_deadline_s)
            if args.deadline_given else scenario.queue.max_deadline_s,
            max_depth=args.max_queue_depth if args.depth_given else scenario.queue.max_depth))
    return scenario


def _fmt(v: float | None, unit: str = "s") -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.0f} ms" if unit == "s" and v < 1 else f"{v:.2f} {unit}"


def render(report: SimReport, speed: Any) -> str:
    r = report
    rej = ", ".join(f"{k} {v}" for k, v in sorted(r.rejected.items())) or "none"
    res = r.resident_per_request
    lines = [
        f"deployment: {r.backends} backend(s) x {r.capacity_tokens} KV tokens, reservation "
        f"{r.reservation}, clients send max_tokens={r.client}",
        f"trace: {r.requests} requests over {r.trace_span_s:.0f} s (virtual {r.virtual_s:.0f} s)",
        f"engine speed (assumed): {speed.decode_step_ms:g} ms/step + {speed.per_seq_ms:g} ms/"
        f"sequence, prefill {speed.prefill_tokens_per_s:g} tokens/s, "
        f"max_num_seqs {speed.max_num_seqs}",
        "",
        "the three production numbers:",
        "  peak concurrent sequences: " + ", ".join(
            f"{k} {v}" for k, v in r.peak_concurrent.items()),
        f"  resident tokens per request: p50 {res['p50']}, p95 {res['p95']}, p99 {res['p99']}",
        f"  minimum headroom: {r.min_headroom_tokens} tokens on {r.min_headroom_backend} "
        f"at t={r.min_headroom_at_s:.1f} s",
        "",
        f"KV use (engine blocks): mean {r.kv_use['mean']:.1%}, p95 {r.kv_use['p95']:.1%}, "
        f"peak {r.kv_use['peak']:.1%}; kvgate ledger: mean {r.ledger_use['mean']:.1%}, "
        f"peak {r.ledger_use['peak']:.1%}",
        f"queue wait: p50 {_fmt(r.queue_wait_s['p50'])}, p99 {_fmt(r.queue_wait_s['p99'])}",
        f"time to first token: p50 {_fmt(r.ttft_s['p50'])}, p99 {_fmt(r.ttft_s['p99'])}",
        f"rejections: {r.rejected_total} ({r.rejected_ratio:.2%}): {rej}",
        f"  answered after: p50 {_fmt(r.rejection_latency_s['p50'])}, "
        f"p99 {_fmt(r.rejection_latency_s['p99'])} from arrival",
        *([f"  retries after Retry-After: {r.retries}, admitted on that try "
           f"{r.retries_admitted} ({r.retries_admitted / r.retries:.0%})"] if r.retries else []),
        f"preemptions: {r.preemptions}",
        f"goodput (completed with TTFT <= {r.ttft_slo_s:g} s): {r.goodput} of {r.requests} "
        f"({r.goodput_ratio:.2%})",
    ]
    return "\n".join(lines)


def _sweep_table(reports: list[SimReport], slo: Slo | None) -> str:
    head = (f"{'deployment':<16} {'rejected':>9} {'p99 wait':>9} {'p99 ttft':>9} "
            f"{'goodput':>8} {'preempt':>8} {'peak kv':>8}" + ("  slo" if slo else ""))
    rows = [head]
    for r in reports:
        row = (f"{r.label:<16} {r.rejected_ratio:>9.2%} {_fmt(r.queue_wait_s['p99']):>9} "
               f"{_fmt(r.ttft_s['p99']):>9} {r.goodput_ratio:>8.2%} {r.preemptions:>8} "
               f"{r.kv_use['peak']:>8.1%}")
        if slo:
            fails = slo.failures(r)
            row += "  ok" if not fails else "  no: " + "; ".join(fails)
        rows.append(row)
    return "\n".join(rows)


def plot(report: SimReport, path: str) -> None:
    """Resident vs capacity, and queue depth, over virtual time (matplotlib, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [p["t"] for p in report.timeline]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 6))
    top.plot(t, [p["engine_tokens"] for p in report.timeline], label="engine KV in use")
    top.plot(t, [p["reserved_tokens"] for p in report.timeline], label="kvgate reserved")
    top.plot(t, [p["target_tokens"] for p in report.timeline], label="admission target",
             linestyle=":")
    top.plot(t, [p["capacity_tokens"] for p in report.timeline], label="capacity",
             linestyle="--")
    top.set_ylabel("tokens (all backends)")
    top.legend(loc="upper right")
    bottom.plot(t, [p["queue_depth"] for p in report.timeline], color="tab:red")
    bottom.set_ylabel("queue depth")
    bottom.set_xlabel("virtual time (s)")
    fig.suptitle(f"kvgate simulate: {report.backends} x {report.capacity_tokens} tokens, "
                 f"{report.reservation}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run_simulate(args: argparse.Namespace) -> int:
    base = build_scenario(args)
    slo = parse_slo(args.slo) if args.slo else None

    def trace(speed: float) -> Any:
        return load_trace(args.trace, start_s=args.start, duration_s=args.duration,
                          speed=speed)

    if not args.sweep:
        report = simulate(trace(args.speed), base)
        if args.plot:
            plot(report, args.plot)
        if args.json:
            out = report.as_dict()
            if slo:
                out["slo"] = {"text": slo.text, "failures": slo.failures(report)}
            print(json.dumps(out, indent=2))
        else:
            print(render(report, base.speed))
            if slo:
                fails = slo.failures(report)
                print(f"SLO {slo.text}: " + ("met" if not fails else "missed: " + "; ".join(fails)))
        return 0
    key, values = parse_sweep(args.sweep)
    if key in ("tp", "memory") and (args.config or args.kv_tokens):
        raise ValueError(f"--sweep {key} recomputes capacity from kvgate plan's flags "
                         "(--model-config, --usable-memory, ...): drop --config/--kv-tokens")
    reports: list[SimReport] = []
    cached = trace(args.speed)
    for value in values:
        requests = cached
        scenario = replace(base, label=f"{key}={value}")
        if key == "backends":
            scenario = replace(scenario, backends=int(float(value)))
        elif key == "kv_tokens":
            scenario = replace(scenario, capacity_tokens=int(float(value)))
        elif key == "speed":
            requests = trace(float(value) * args.speed)
        else:  # tp or memory: the capacity of one backend, as kvgate plan computes it
            changed = argparse.Namespace(**vars(args))
            if key == "tp":
                changed.tp = int(float(value))
            else:
                changed.usable_memory = value
            capacity, _ = _capacity_from_flags(changed)
            scenario = replace(scenario, capacity_tokens=capacity)
        reports.append(simulate(requests, scenario))
    best = next((r for r in reports if slo and not slo.failures(r)), None)
    if args.json:
        print(json.dumps({"sweep": key, "slo": slo.text if slo else None,
                          "smallest_meeting_slo": best.label if best else None,
                          "runs": [r.as_dict() for r in reports]}, indent=2))
        return 0
    print(f"trace {Path(args.trace).name}: {reports[0].requests} requests; "
          f"{base.capacity_tokens} KV tokens per backend, reservation {base.reservation}, "
          f"clients send max_tokens={base.client}")
    print(_sweep_table(reports, slo))
    if slo:
        print(f"smallest deployment meeting {slo.text}: "
              + (best.label if best else "none in this sweep"))
    return 0


class _Given(argparse.Action):
    """Store the value and note it was given, so it overrides the config file's."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{'deadline' if self.dest == 'deadline' else 'depth'}_given", True)


def add_simulate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("simulate", help="replay a trace against a candidate deployment "
                       "in virtual time: how many GPUs for this traffic")
    p.add_argument("--trace", required=True, help="Azure LLM CSV, Mooncake JSONL, or kvgate's "
                   "request log (JSON lines with prompt_tokens, output_tokens, ts)")
    p.add_argument("--start", type=float, default=0.0, help="slice start, s into the trace")
    p.add_argument("--duration", type=float, help="slice length in trace seconds")
    p.add_argument("--speed", type=float, default=1.0, help="time compression (2 = twice "
                   "the arrival rate)")
    dep = p.add_argument_group("deployment (a config file, or kvgate plan's flags)")
    dep.add_argument("--config", help="a kvgate TOML config: capacity, queue, reservation")
    dep.add_argument("--model", help="which model of the config (default: the first)")
    dep.add_argument("--backends", type=int, help="backends (engines) serving the model")
    dep.add_argument("--kv-tokens", type=int, help="KV pool of each backend, in tokens")
    dep.add_argument("--model-config", help="a Hugging Face config.json")
    dep.add_argument("--layers", type=int)
    dep.add_argument("--kv-heads", type=int)
    dep.add_argument("--head-dim", type=int)
    dep.add_argument("--params", help="parameter count, e.g. 14e9")
    dep.add_argument("--weight-bits", type=int, default=16)
    dep.add_argument("--weights-bytes")
    dep.add_argument("--kv-bits", type=int)
    dep.add_argument("--kv-dtype")
    dep.add_argument("--usable-memory", help="memory per GPU with unit, e.g. 80GiB")
    dep.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    dep.add_argument("--overhead", type=float)
    dep.add_argument("--reserve-bytes")
    dep.add_argument("--tp", type=int, default=1)
    dep.add_argument("--pp", type=int, default=1)
    dep.add_argument("--block-size", type=int, default=16)
    dep.add_argument("--max-model-len", type=int, help="default: the config's, else 8192")
    dep.add_argument("--reservation", choices=["strict", "adaptive"])
    eng = p.add_argument_group("engine speed (assumptions: the benchmark suite's defaults)")
    eng.add_argument("--decode-step-ms", type=float, default=_SPEED.decode_step_ms)
    eng.add_argument("--per-seq-ms", type=float, default=_SPEED.per_seq_ms)
    eng.add_argument("--prefill-tokens-per-s", type=float,
                     default=_SPEED.prefill_tokens_per_s)
    eng.add_argument("--max-num-seqs", type=int, default=_SPEED.max_num_seqs)
    eng.add_argument("--no-prefix-caching", action="store_true",
                     help="engines without prefix caching (a Mooncake trace's hash ids then "
                          "share nothing)")
    dep.add_argument("--prefix-sharing", choices=["auto", "off"],
                     help="kvgate charges shared prefix blocks once (auto, the default) or "
                          "every prompt whole (off)")
    q = p.add_argument_group("queue (override the config's)")
    q.add_argument("--deadline", type=float, default=_QUEUE.default_deadline_s,
                   action=_Given, help="queue deadline in s")
    q.add_argument("--max-queue-depth", type=int, default=_QUEUE.max_depth, action=_Given)
    p.add_argument("--client", default="recorded", help="max_tokens clients send: recorded, "
                   "cap-N, or none (the engine fills max_model_len - prompt)")
    p.add_argument("--ttft-slo", type=float, default=2.0, help="goodput: TTFT at most this (s)")
    p.add_argument("--retries", type=int, default=0,
                   help="a refused client waits the Retry-After it got and sends again, up "
                        "to this many times (the report gives how many got in on that try)")
    p.add_argument("--no-tickets", action="store_true",
                   help="retrying clients do not send back the ticket their 429 carried")
    p.add_argument("--sample-s", type=float, default=1.0, help="timeline resolution (s)")
    p.add_argument("--sweep", help="backends=1..8, kv_tokens=A,B,..., speed=1,2,4, tp=1,2,4 "
                   "or memory=40GiB,80GiB (the last two with kvgate plan's flags)")
    p.add_argument("--slo", help='e.g. "p99_queue_wait<=2s,rejected<=1%%"')
    p.add_argument("--plot", help="write resident vs capacity and queue depth to FILE.png")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_simulate, deadline_given=False, depth_given=False)


_SLO_TERM = re.compile(r"^\s*([a-z0-9_]+)\s*(<=|>=)\s*([0-9.]+)\s*(ms|s|%)?\s*$")
_SLO_KEYS = ("p50_queue_wait", "p99_queue_wait", "p50_ttft", "p99_ttft", "rejected",
             "goodput", "preemptions")


@dataclass(frozen=True, slots=True)
class Slo:
    """`key<=value` / `key>=value` terms; times in s (or ms), ratios as % or fractions."""

    terms: tuple[tuple[str, str, float], ...]
    text: str

    def value(self, report: SimReport, key: str) -> float:
        if key == "rejected":
            return report.rejected_ratio
        if key == "goodput":
            return report.goodput_ratio
        if key == "preemptions":
            return float(report.preemptions)
        which, name = key.split("_", 1)
        table = report.queue_wait_s if name == "queue_wait" else report.ttft_s
        v = table.get(which)
        return math.inf if v is None else v

    def failures(self, report: SimReport) -> list[str]:
        out = []
        for key, op, limit in self.terms:
            v = self.value(report, key)
            ok = v <= limit if op == "<=" else v >= limit
            if not ok:
                out.append(f"{key}={v:g} (want {op}{limit:g})")
        return out


def parse_slo(text: str) -> Slo:
    terms: list[tuple[str, str, float]] = []
    for part in text.split(","):
        m = _SLO_TERM.match(part)
        if m is None or m.group(1) not in _SLO_KEYS:
            raise ValueError(f"SLO term {part.strip()!r}: want KEY<=N or KEY>=N with KEY one "
                             f"of {', '.join(_SLO_KEYS)} (e.g. p99_queue_wait<=2s,rejected<=1%)")
        key, op, num, unit = m.group(1), m.group(2), float(m.group(3)), m.group(4)
        if unit == "ms":
            num /= 1000
        elif unit == "%":
            num /= 100
        terms.append((key, op, num))
    return Slo(tuple(terms), text)


_SWEEP_KEYS = ("backends", "kv_tokens", "speed", "tp", "memory")


def parse_sweep(text: str) -> tuple[str, list[str]]:
    """`backends=1..8`, `backends=1,2,4`, `kv_tokens=32768,65536`, `speed=1,2,4`,
    `tp=1,2,4`, `memory=40GiB,80GiB` (the last two recompute capacity with `kvgate
    plan`'s arithmetic, so they need its flags rather than a config file)."""
    key, sep, values = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or key not in _SWEEP_KEYS:
        raise ValueError(f"--sweep wants KEY=VALUES with KEY one of {', '.join(_SWEEP_KEYS)}. "
                         f"Given: {text!r}")
    if key == "memory":
        out_text = [v.strip() for v in values.split(",") if v.strip()]
        if not out_text:
            raise ValueError(f"--sweep memory wants sizes with units. Given: {values!r}")
        return key, out_text
    out: list[float] = []
    for part in values.split(","):
        lo, dots, hi = part.partition("..")
        try:
            if dots:
                out.extend(float(v) for v in range(int(lo), int(hi) + 1))
            else:
                out.append(float(part))
        except ValueError:
            raise ValueError(f"--sweep value {part!r} is not a number or A..B") from None
    if not out or any(v <= 0 for v in out):
        raise ValueError(f"--sweep values must be > 0. Given: {values!r}")
    return key, [f"{v:g}" for v in out]
