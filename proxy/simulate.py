"""Capacity from traffic: replay a request trace against a candidate deployment.

`kvgate simulate` answers "how many GPUs for this traffic" by running the very code
that serves it: `AdmissionController` (queue, ordering, placement, rejections),
the reservation modes (`strict`, or `adaptive` with `ReservationTracker` resizing
leases from simulated progress and `AdmissionTarget` reading the engine's
preemptions and KV use) and `SimEngine` (block pool, continuous batching,
recompute preemption), all in virtual time.

Why a virtual-time event loop rather than a second, pure engine step: the
controller, the tracker and the engine are asyncio code whose behaviour depends on
the order in which futures resolve and timers fire. A copy of that logic as pure
functions would drift from what production runs; a loop whose clock jumps to the
next timer when nothing is ready runs the unchanged code, in the same order,
without sleeping. `VirtualClockLoop` is that loop: an ordinary selector loop whose
`time()` is a counter and whose selector, asked to wait `t` seconds, adds `t` to
the counter and returns at once. Nothing here opens a socket.

What the replay stands in for, and how (so the numbers can be read right):
* Clients stream chat completions with `max_tokens` per `ClientBehaviour`; the
  engine always stops at the recorded output length, as a model sampling EOS.
* kvgate sees a stream's progress as the events it forwards: one role event, one
  per token, then the finish event and `[DONE]` — the same counts the tracker
  reads live, fed here by a sink on the engine's output instead of a socket.
* The engine poll (`vllm:kv_cache_usage_perc`, `vllm:num_preemptions_total`) and
  the resize timer run at the configured intervals in virtual time.
* Prompt counting, HTTP and the network cost nothing here.
"""

from __future__ import annotations

import asyncio
import csv
import json
import math
import re
import selectors
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from policies.output import OutputPolicy, decide_output
from policies.placement import PlacementName
from policies.reservation import AdmissionTarget, ReservationMode
from proxy.admission import Backend, Demand, Lease, ReleaseRate, controller_for
from proxy.capacity import cdiv
from proxy.config import AdaptiveConfig, QueueConfig
from proxy.errors import KvgateError
from proxy.ledger import MemoryLedger
from proxy.reservation import (
    Progress,
    ReservationTracker,
    apply_engine_report,
    follow_adaptively,
)
from proxy.sim.engine import EngineConfig, OutputLength, SimEngine

__all__ = [
    "ClientBehaviour", "EngineSpeed", "Scenario", "SimReport", "Slo", "TraceRequest",
    "VirtualClockLoop", "load_trace", "parse_slo", "parse_sweep", "simulate",
]

REJECTION_REASONS = ("queue_full", "queue_timeout", "request_too_large",
                     "context_length_exceeded", "max_tokens_required", "no_backend",
                     "engine_refused")


# ----------------------------------------------------------------------------- traces


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceRequest:
    """One request as replayed: arrival (s from the slice start), prompt, recorded output."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def _azure(path: Path) -> list[tuple[float, int, int]]:
    rows: list[tuple[float, int, int]] = []
    first: datetime | None = None
    with path.open(newline="") as f:
        for i, rec in enumerate(csv.DictReader(f), start=2):
            try:
                stamp = datetime.strptime(rec["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f")
                first = first or stamp
                rows.append(((stamp - first).total_seconds(), int(rec["ContextTokens"]),
                             int(rec["GeneratedTokens"])))
            except (KeyError, ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{i}: not an Azure LLM trace row ({exc})") from None
    return rows


def _stamp_s(value: Any) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    raise ValueError(f"unreadable timestamp {value!r}")


def _jsonl(path: Path) -> list[tuple[float, int, int]]:
    """Mooncake (`timestamp` ms, `input_length`, `output_length`) or kvgate's request log.

    kvgate's `kvgate.request` lines carry `prompt_tokens`; the arrival is `ts`,
    `time` or `timestamp` (epoch seconds or ISO 8601, as a log formatter adds it) and
    the output `output_tokens` or `completion_tokens`. Lines whose `outcome` is not
    `completed` are replayed too: they are demand the deployment must answer.
    """
    rows: list[tuple[float, int, int]] = []
    with path.open() as f:
        for i, line in enumerate(f, start=1):
            line = line.strip()
            if not line:
                continue
            brace = line.find("{")  # a log line may carry a formatter's prefix
            try:
                rec = json.loads(line[brace:] if brace > 0 else line)
                if "input_length" in rec:  # Mooncake
                    rows.append((float(rec["timestamp"]) / 1000, int(rec["input_length"]),
                                 int(rec["output_length"])))
                    continue
                stamp = next((rec[k] for k in ("ts", "time", "timestamp") if k in rec), None)
                out = next((rec[k] for k in ("output_tokens", "completion_tokens") if k in rec),
                           None)
                if stamp is None or out is None or rec.get("prompt_tokens") is None:
                    raise ValueError("needs prompt_tokens, output_tokens (or completion_tokens) "
                                     "and ts (or time, timestamp)")
                rows.append((_stamp_s(stamp), int(rec["prompt_tokens"]), int(out)))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{i}: not a trace line ({exc})") from None
    return rows


def load_trace(path: str | Path, *, start_s: float = 0.0, duration_s: float | None = None,
               speed: float = 1.0) -> list[TraceRequest]:
    """The trace's requests in arrival order, sliced and time-compressed by `speed`.

    `start_s` and `duration_s` are in trace time (before compression). Rows with a
    prompt of 0 tokens are dropped (no engine accepts them); output 0 becomes 1.
    """
    p = Path(path)
    if not speed > 0:
        raise ValueError(f"`speed` must be > 0. Given: {speed}")
    rows = _azure(p) if p.suffix.lower() == ".csv" else _jsonl(p)
    if not rows:
        raise ValueError(f"{p}: no requests")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    out: list[TraceRequest] = []
    for t, prompt, output in rows:
        rel = t - t0 - start_s
        if rel < 0 or (duration_s is not None and rel >= duration_s) or prompt < 1:
            continue
        out.append(TraceRequest(arrival_s=rel / speed, prompt_tokens=prompt,
                                output_tokens=max(1, output)))
    return out


# ----------------------------------------------------------------------------- virtual time


class _JumpSelector(selectors.SelectSelector):
    """Asked to wait, move the virtual clock instead and report nothing ready."""

    def __init__(self, clock: list[float]) -> None:
        super().__init__()
        self._clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise RuntimeError("virtual-time loop: nothing scheduled and nothing ready "
                               "(every task waits on a future nobody resolves)")
        if timeout > 0:
            self._clock[0] += timeout
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An asyncio loop whose clock jumps to the next timer: an hour runs in seconds.

    Only for code that does no I/O: a socket registered here would never be
    reported ready.
    """

    def __init__(self) -> None:
        self._vclock = [0.0]
        super().__init__(selector=_JumpSelector(self._vclock))

    def time(self) -> float:
        return self._vclock[0]


# ----------------------------------------------------------------------------- scenario


class ClientBehaviour:
    """What clients send as max_tokens: `recorded`, `cap-N` or `none` (engine default)."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.cap: int | None = None
        if spec.startswith("cap-"):
            try:
                self.cap = int(spec[4:])
            except ValueError:
                self.cap = 0
            if self.cap < 1:
                raise ValueError(f"client behaviour `cap-N` needs N >= 1. Given: {spec!r}")
        elif spec not in ("recorded", "none"):
            raise ValueError(f"client behaviour must be recorded, cap-N or none. Given: {spec!r}")

    def max_tokens(self, output_tokens: int) -> int | None:
        if self.spec == "recorded":
            return output_tokens
        return self.cap

    def __str__(self) -> str:
        return self.spec


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSpeed:
    """The engine's time model (see proxy/sim/engine.py); defaults are assumptions.

    They are the benchmark suite's defaults (a mid-size model on one GPU): 20 ms a
    decode step, 0.2 ms more per running sequence, prefill at 40,000 tokens/s.
    Measure your engine (`vllm bench`, or a step trace) and pass its figures.
    """

    decode_step_ms: float = 20.0
    per_seq_ms: float = 0.2
    prefill_tokens_per_s: float = 40000.0
    max_num_seqs: int = 256


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """A candidate deployment of one model and the client behaviour replayed against it."""

    capacity_tokens: int  # per backend (one engine: tp GPUs)
    backends: int = 2
    block_size: int = 16
    max_model_len: int = 8192
    queue: QueueConfig = field(default_factory=QueueConfig)
    reservation: ReservationMode = ReservationMode.ADAPTIVE
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    output: OutputPolicy = field(default_factory=OutputPolicy)
    placement: PlacementName = PlacementName.BEST_FIT
    speed: EngineSpeed = field(default_factory=EngineSpeed)
    client: str = "recorded"
    ttft_slo_s: float = 2.0
    sample_interval_s: float = 1.0
    ledger_tokens: Callable[[int], int] | None = None  # default: block-rounded
    label: str = ""

    def ledger(self, tokens: int) -> int:
        if self.ledger_tokens is not None:
            return self.ledger_tokens(tokens)
        return cdiv(tokens, self.block_size) * self.block_size


# ----------------------------------------------------------------------------- report


def _quantile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank quantile; None when there is nothing to rank."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass(slots=True, kw_only=True)
class SimReport:
    """What one replay measured; `as_dict` is the `--json` output."""

    label: str
    backends: int
    capacity_tokens: int
    reservation: str
    client: str
    requests: int
    completed: int
    rejected: dict[str, int]
    trace_span_s: float
    virtual_s: float
    # the three production numbers
    peak_concurrent: dict[str, int]
    resident_per_request: dict[str, float | None]
    min_headroom_tokens: int
    min_headroom_at_s: float
    min_headroom_backend: str
    # KV use over time (the engines' blocks in use, 0..1 of each pool, all backends)
    kv_use: dict[str, float]
    ledger_use: dict[str, float]
    queue_wait_s: dict[str, float | None]
    ttft_s: dict[str, float | None]
    preemptions: int
    ttft_slo_s: float
    goodput: int
    goodput_ratio: float
    timeline: list[dict[str, float]] = field(default_factory=list)

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

    @property
    def rejected_ratio(self) -> float:
        return self.rejected_total / self.requests if self.requests else 0.0

    def as_dict(self, *, timeline: bool = False) -> dict[str, Any]:
        out = asdict(self)
        out["rejected_total"] = self.rejected_total
        out["rejected_ratio"] = round(self.rejected_ratio, 6)
        if not timeline:
            out.pop("timeline")
        return out


# ----------------------------------------------------------------------------- the replay


class _StreamSink(asyncio.Queue[tuple[int, int | None]]):
    """The engine's output for one sequence, read as kvgate reads a stream.

    Each token is one SSE event forwarded (the tracker's progress signal); the first
    also marks the time to first token. No task wakes per token: only the end
    resolves `done`, which keeps an hour of decode steps cheap.
    """

    def __init__(self, progress: Progress | None, clock: Callable[[], float]) -> None:
        super().__init__()
        self.progress = progress
        self.clock = clock
        self.first_token_s: float | None = None
        self.generated = 0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def put_nowait(self, item: tuple[int, int | None]) -> None:
        _, tokens = item
        p = self.progress
        if tokens is None:
            if p is not None:
                p.events += 2  # the finish event and [DONE]
            if not self.done.done():
                self.done.set_result(None)
            return
        if self.first_token_s is None:
            self.first_token_s = self.clock()
            if p is not None:
                p.first_event_s = self.first_token_s
                p.events += 1  # the role event goes out with the first token
        self.generated = tokens
        if p is not None:
            p.events += 1


class _Replay:
    """One run: the controller, the tracker, the engines and the bookkeeping."""

    def __init__(self, scenario: Scenario, loop: asyncio.AbstractEventLoop) -> None:
        s = self.s = scenario
        self.loop = loop
        if s.capacity_tokens < s.block_size:
            raise ValueError(f"capacity of {s.capacity_tokens} tokens holds no KV block")
        self.ledger = MemoryLedger()
        self.backends = [Backend(name=f"backend-{i}", url=f"sim://{i}",
                                 capacity_tokens=s.capacity_tokens) for i in range(s.backends)]
        self.controller = controller_for(model="simulated", backends=self.backends,
                                         ledger=self.ledger, queue=s.queue,
                                         placement=s.placement, on_event=self._on_event)
        self.controller.release_rate = ReleaseRate(clock=loop.time)
        self.tracker: ReservationTracker | None = None
        self.targets: dict[str, AdmissionTarget] = {}
        if s.reservation is ReservationMode.ADAPTIVE:
            a = s.adaptive
            self.tracker, self.targets = follow_adaptively(
                self.controller, quantile=a.quantile, min_samples=a.min_samples,
                history=a.history, resize_interval_s=a.resize_interval_s,
                ledger_tokens=s.ledger, block_size=s.block_size)
        self.engines = {
            b.name: SimEngine(EngineConfig(
                kv_tokens=s.capacity_tokens, block_size=s.block_size,
                max_num_seqs=s.speed.max_num_seqs,
                prefill_tokens_per_s=s.speed.prefill_tokens_per_s,
                decode_step_ms=s.speed.decode_step_ms, per_seq_ms=s.speed.per_seq_ms,
                output_length=OutputLength.MAX))
            for b in self.backends
        }
        self.client = ClientBehaviour(s.client)
        self.rejected = dict.fromkeys(REJECTION_REASONS, 0)
        self.peaks = {b.name: 0 for b in self.backends}
        self.min_headroom = (s.capacity_tokens, 0.0, self.backends[0].name)
        self.waits: list[float] = []
        self.ttfts: list[float] = []
        self.resident_per_request: list[int] = []
        self.completed = 0
        self.good = 0
        self.timeline: list[dict[str, float]] = []

    # ---------------------------------------------------------------- bookkeeping
    def _on_event(self, kind: str, lease: Lease | None) -> None:
        """The production numbers, with `Metrics.backend_state`'s definitions."""
        if lease is None:
            return
        b = lease.backend
        if b.inflight > self.peaks[b.name]:
            self.peaks[b.name] = b.inflight
        headroom = b.capacity_tokens - self.ledger.resident(b.name)
        if headroom < self.min_headroom[0]:
            self.min_headroom = (headroom, self.loop.time(), b.name)

    def _sample(self) -> None:
        point: dict[str, float] = {"t": self.loop.time(),
                                   "queue_depth": float(self.controller.queue_depth)}
        used = reserved = 0
        for b in self.backends:
            engine = self.engines[b.name]
            used += engine.blocks_used * self.s.block_size
            reserved += self.ledger.resident(b.name)
        cap = self.s.capacity_tokens * len(self.backends)
        point["engine_tokens"] = float(used)
        point["reserved_tokens"] = float(reserved)
        point["capacity_tokens"] = float(cap)
        point["target_tokens"] = float(sum(b.target_tokens for b in self.backends))
        self.timeline.append(point)

    # ---------------------------------------------------------------- one request
    async def request(self, spec: TraceRequest) -> None:
        s = self.s
        loop = self.loop
        arrival = loop.time()
        prompt = spec.prompt_tokens
        requested = self.client.max_tokens(spec.output_tokens)
        engine_default = max(0, s.max_model_len - prompt)  # chat: the engine fills the context
        decision = decide_output(s.output, requested=requested, engine_default=engine_default)
        if decision.missing:
            self.rejected["max_tokens_required"] += 1
            return
        max_tokens = decision.max_tokens
        if prompt + max_tokens > s.max_model_len or max_tokens < 1:
            self.rejected["context_length_exceeded"] += 1
            return
        strict = self.tracker is None
        if self.tracker is not None:
            tokens = self.tracker.lease_tokens(prompt_tokens=prompt, max_tokens=max_tokens, n=1,
                                               min_tokens=0, strict=False)
        else:
            tokens = s.ledger(prompt + max_tokens)
        demand = Demand(tokens=tokens, prompt_tokens=prompt, max_tokens=max_tokens,
                        follow=not strict)
        deadline = arrival + min(s.queue.default_deadline_s, s.queue.max_deadline_s)
        try:
            lease = await self.controller.acquire(demand, deadline)
        except KvgateError as exc:
            self.rejected[exc.code] = self.rejected.get(exc.code, 0) + 1
            return
        self.waits.append(loop.time() - arrival)
        progress: Progress | None = None
        finished = False
        try:
            if self.tracker is not None:
                progress = Progress(lease=lease, prompt_tokens=prompt, max_tokens=max_tokens,
                                    n=1, min_tokens=0, strict=strict, stream=True, chat=True,
                                    started_s=loop.time())
                self.tracker.track(progress)
            engine = self.engines[lease.backend.name]
            engine_max = requested if decision.set_max_tokens is None else decision.set_max_tokens
            engine_max = engine_default if engine_max is None else engine_max
            if not engine.fits_ever(prompt, engine_max):
                self.rejected["engine_refused"] += 1  # the engine's 400, as `kvgate sim` answers
                return
            sink = _StreamSink(progress, loop.time)
            engine.submit(prompt_tokens=prompt, max_tokens=engine_max, out=sink,
                          eos_after=spec.output_tokens)
            await sink.done
            finished = True
            self.completed += 1
            self.resident_per_request.append(s.ledger(prompt + sink.generated))
            if sink.first_token_s is not None:
                ttft = sink.first_token_s - arrival
                self.ttfts.append(ttft)
                if ttft <= s.ttft_slo_s:
                    self.good += 1
            if progress is not None:  # what the final usage chunk tells the tracker
                progress.tail += b'"usage":{"completion_tokens":%d}' % sink.generated
        finally:
            if progress is not None and self.tracker is not None:
                self.tracker.finish(progress, loop.time(),
                                    completed=finished)
            lease.release()

    # ---------------------------------------------------------------- timers
    async def _every(self, interval: float, action: Callable[[], Any]) -> None:
        while True:
            result = action()
            if asyncio.iscoroutine(result):
                await result
            await asyncio.sleep(interval)

    async def _resize(self) -> None:
        assert self.tracker is not None
        await self.tracker.tick(self.controller, self.loop.time())

    def _engine_poll(self) -> None:
        """What `_engine_loop` does with a scrape, from the engine object itself."""
        now = self.loop.time()
        for b in self.backends:
            engine = self.engines[b.name]
            assert self.tracker is not None
            before = apply_engine_report(
                self.tracker, b, self.targets[b.name], now=now,
                preemptions_total=engine.preemptions,
                usage_ratio=engine.blocks_used / engine.config.num_blocks,
                reserved_tokens=self.ledger.resident(b.name))
            if b.target_factor > before:
                self.controller.kick()

    async def run(self, requests: Sequence[TraceRequest]) -> SimReport:
        loop = self.loop
        for engine in self.engines.values():
            engine.start()
        timers = [loop.create_task(self._every(self.s.sample_interval_s, self._sample))]
        if self.tracker is not None:
            a = self.s.adaptive
            timers.append(loop.create_task(self._every(a.resize_interval_s, self._resize)))
            timers.append(loop.create_task(self._every(a.engine_poll_interval_s,
                                                       self._engine_poll)))
        tasks: list[asyncio.Task[None]] = []
        t0 = loop.time()
        for spec in requests:
            delay = t0 + spec.arrival_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(loop.create_task(self.request(spec)))
        await asyncio.gather(*tasks)
        self._sample()
        for task in timers:
            task.cancel()
        await asyncio.gather(*timers, return_exceptions=True)
        for engine in self.engines.values():
            await engine.stop()
        return self._report(requests, loop.time() - t0)

    def _report(self, requests: Sequence[TraceRequest], virtual_s: float) -> SimReport:
        s = self.s
        cap = s.capacity_tokens * len(self.backends)
        kv = [p["engine_tokens"] / cap for p in self.timeline] or [0.0]
        led = [p["reserved_tokens"] / cap for p in self.timeline] or [0.0]
        n = len(requests)

        def spread(values: Sequence[float]) -> dict[str, float]:
            return {"mean": round(sum(values) / len(values), 4),
                    "p95": round(_quantile(values, 0.95) or 0.0, 4),
                    "peak": round(max(values), 4)}

        def pct(values: Sequence[float], qs: Iterable[float]) -> dict[str, float | None]:
            out: dict[str, float | None] = {}
            for q in qs:
                v = _quantile(values, q)
                out[f"p{round(q * 100)}"] = None if v is None else round(v, 4)
            return out

        headroom, at_s, where = self.min_headroom
        return SimReport(
            label=s.label, backends=s.backends, capacity_tokens=s.capacity_tokens,
            reservation=str(s.reservation), client=s.client, requests=n,
            completed=self.completed,
            rejected={k: v for k, v in self.rejected.items() if v},
            trace_span_s=round(requests[-1].arrival_s if requests else 0.0, 3),
            virtual_s=round(virtual_s, 3),
            peak_concurrent=dict(self.peaks),
            resident_per_request=pct([float(v) for v in self.resident_per_request],
                                     (0.5, 0.95, 0.99)),
            min_headroom_tokens=headroom, min_headroom_at_s=round(at_s, 3),
            min_headroom_backend=where,
            kv_use=spread(kv), ledger_use=spread(led),
            queue_wait_s=pct(self.waits, (0.5, 0.99)),
            ttft_s=pct(self.ttfts, (0.5, 0.99)),
            preemptions=sum(e.preemptions for e in self.engines.values()),
            ttft_slo_s=s.ttft_slo_s, goodput=self.good,
            goodput_ratio=round(self.good / n, 6) if n else 0.0,
            timeline=self.timeline,
        )


def simulate(requests: Sequence[TraceRequest], scenario: Scenario) -> SimReport:
    """Replay `requests` against `scenario` in virtual time; deterministic for a trace."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(_Replay(scenario, loop).run(requests))
    finally:
        loop.close()


# ----------------------------------------------------------------------------- sweep, SLO


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
