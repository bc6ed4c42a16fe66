"""Capacity from traffic: replay a request trace against a candidate deployment.

`kvgate simulate` answers "how many GPUs for this traffic" by running the very code
that serves it: each trace request goes through `Gate.handle`, the pipeline
`kvgate serve` runs (demand and context check, output policy, block rounding,
admission with its queue, ordering and placement, the lease's life, adaptive
resizing and engine feedback on the gate's own timers), with a `send` that runs
the request in `SimEngine` (block pool, continuous batching, recompute
preemption) instead of forwarding it, all in virtual time.

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
import functools
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from policies.engines import EngineKind, PrefixSharing
from policies.output import OutputPolicy
from policies.placement import PlacementName
from policies.reservation import ReservationMode
from proxy.admission import Backend, Lease
from proxy.ask import Admitted, Ask, Record
from proxy.capacity import Deployment
from proxy.config import AdaptiveConfig, BackendConfig, ModelConfig, QueueConfig
from proxy.engine_feedback import every
from proxy.engine_metrics import EngineLoad
from proxy.errors import KvgateError
from proxy.gate import Gate
from proxy.ledger import MemoryLedger
from proxy.metrics import Metrics
from proxy.prefix_blocks import shareable_blocks
from proxy.replay_report import SimReport, quantile
from proxy.reservation import Progress
from proxy.sim.engine import EngineConfig, OutputLength, SimEngine
from proxy.sim.kv_cache import block_hashes_from_hash_ids
from proxy.tickets import Tickets
from proxy.traces import HASH_ID_TOKENS, TraceRequest, load_trace
from proxy.validation import Endpoint, ValidRequest
from proxy.virtual_time import VirtualClockLoop

__all__ = [
    "ClientBehaviour", "EngineSpeed", "Scenario", "SimReport", "TraceRequest",
    "VirtualClockLoop", "load_trace", "simulate",
]

ENGINE_REFUSED = "engine_refused"  # the engine's own 400, as `kvgate sim` answers it


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
    deployment: Deployment | None = None  # hybrid layouts: its ledger tokens; else blocks
    label: str = ""
    # The engines' prefix caching (vLLM v1's, on by default) and kvgate's prefix sharing:
    # a trace with hash ids (Mooncake's) shares prefixes in both.
    prefix_caching: bool = True
    prefix_sharing: PrefixSharing = PrefixSharing.AUTO
    # A refused client waits the `retry-after-ms` kvgate sent (what the OpenAI SDKs read
    # first) and sends again, up to this many times; its TTFT counts from the first try.
    retries: int = 0
    tickets: bool = True  # a retry brings back the ticket its 429 carried

    def model_config(self) -> ModelConfig:
        """The model as `kvgate serve` would be configured for this deployment."""
        return ModelConfig(
            name="simulated", path=Path("."), max_model_len=self.max_model_len,
            output=self.output, placement=self.placement, deployment=self.deployment,
            block_size=self.block_size, capacity_tokens=self.capacity_tokens,
            capacity_source="scenario", reservation=self.reservation, adaptive=self.adaptive,
            prefix_sharing=self.prefix_sharing,
            backends=tuple(BackendConfig(name=f"backend-{i}", url=f"sim://{i}",
                                         kind=EngineKind.VLLM) for i in range(self.backends)))


# ----------------------------------------------------------------------------- the replay


class _StreamSink(asyncio.Queue[tuple[int, int | None]]):
    """The engine's output for one sequence, read as kvgate reads a stream.

    Each token is one SSE event forwarded (the tracker's progress signal); the first
    also marks the time to first token. No task wakes per token: only the end
    resolves `done`, which keeps an hour of decode steps cheap.
    """

    def __init__(self, progress: Progress | None, clock: Callable[[], float],
                 on_first: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.progress = progress
        self.on_first = on_first
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
            if self.on_first is not None:
                self.on_first()  # as the role event reaches kvgate: the prefill is done
            if p is not None:
                p.first_event_s = self.first_token_s
                p.events += 1  # the role event goes out with the first token
        self.generated = tokens
        if p is not None:
            p.events += 1


@dataclass(frozen=True, slots=True)
class _EngineRun:
    """One request's run in a simulated engine, as the gate's send reports it."""

    status: int
    first_byte_s: float | None = None
    failed_mid_stream: bool = False
    first_token_s: float | None = None
    generated: int = 0


class _NoTickets(Tickets):
    """Tickets that hold no place: the replay of clients that retry without them."""

    def redeem(self, ticket: str, model: str, tenant: str) -> bool:
        return False


def _chat(max_tokens: int | None) -> ValidRequest:
    """A streamed chat as the replay's clients send it; its prompt comes counted."""
    return ValidRequest(endpoint=Endpoint.CHAT, model="simulated", stream=True, n=1,
                        max_tokens=max_tokens, max_tokens_field="max_tokens", n_predict=None,
                        min_tokens=0,
                        ignore_eos=False, chat=None, prompts=(), body={})


class _Replay:
    """One run: the model's gate (as `kvgate serve` builds it), the engines, the books."""

    def __init__(self, scenario: Scenario, loop: asyncio.AbstractEventLoop) -> None:
        s = self.s = scenario
        self.loop = loop
        if s.capacity_tokens < s.block_size:
            raise ValueError(f"capacity of {s.capacity_tokens} tokens holds no KV block")
        self.ledger = MemoryLedger()
        self.gate = Gate(s.model_config(), queue=s.queue, ledger=self.ledger, metrics=Metrics(),
                         counter=None, on_lease=self._on_lease,
                         tickets=Tickets(now=loop.time) if s.tickets else _NoTickets())
        self.controller = self.gate.controller
        self.backends = self.gate.backends
        self.engines = {
            b.name: SimEngine(EngineConfig(
                kv_tokens=s.capacity_tokens, block_size=s.block_size,
                max_num_seqs=s.speed.max_num_seqs,
                prefill_tokens_per_s=s.speed.prefill_tokens_per_s,
                decode_step_ms=s.speed.decode_step_ms, per_seq_ms=s.speed.per_seq_ms,
                output_length=OutputLength.MAX, prefix_caching=s.prefix_caching))
            for b in self.backends
        }
        if not s.prefix_caching:  # as the engines' cache_config_info would say
            for b in self.backends:
                self.controller.set_shares_prefixes(b, False)
        self.shared_tokens = 0
        self.client = ClientBehaviour(s.client)
        self.rejected: dict[str, int] = {}
        self.peaks = {b.name: 0 for b in self.backends}
        self.min_headroom = (s.capacity_tokens, 0.0, self.backends[0].name)
        self.waits: list[float] = []
        self.rejection_waits: list[float] = []
        self.ttfts: list[float] = []
        self.resident_per_request: list[int] = []
        self.completed = 0
        self.good = 0
        self.retries = self.retries_admitted = 0
        self.timeline: list[dict[str, float]] = []
        self.records: list[Record] = []  # one per try, in the order sent
        self._ids = itertools.count()

    # ---------------------------------------------------------------- bookkeeping
    def _on_lease(self, kind: str, lease: Lease) -> None:
        """The production numbers, with `Metrics.backend_state`'s definitions."""
        b = lease.backend
        if b.inflight > self.peaks[b.name]:
            self.peaks[b.name] = b.inflight
        headroom = b.capacity_tokens - self.ledger.resident(b.name)
        if headroom < self.min_headroom[0]:
            self.min_headroom = (headroom, self.loop.time(), b.name)

    async def _sample(self) -> None:
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
        """The trace's request through the gate, as a client's chat through kvgate;
        refused, it may try again after the Retry-After it was given."""
        s = self.s
        arrival = self.loop.time()
        requested = self.client.max_tokens(spec.output_tokens)
        ticket: str | None = None
        for attempt in range(s.retries + 1):
            tried = self.loop.time()
            ask = Ask(request=_chat(requested), raw=b"", prompt_tokens=(spec.prompt_tokens,),
                      blocks=self._ledger_keys(spec), ticket=ticket,
                      deadline=tried + min(s.queue.default_deadline_s, s.queue.max_deadline_s))
            record = Record(request_id=f"replay-{next(self._ids)}")
            self.records.append(record)
            send = functools.partial(self._run_in_engine, spec, requested)
            try:
                run = await self.gate.handle(ask, record, send)
            except KvgateError as exc:
                self.rejection_waits.append(self.loop.time() - tried)
                wait_ms = exc.headers().get("retry-after-ms")
                if attempt < s.retries and wait_ms is not None:
                    self.retries += 1
                    ticket = exc.ticket
                    await asyncio.sleep(int(wait_ms) / 1000)
                    continue
                self.rejected[exc.code] = self.rejected.get(exc.code, 0) + 1
                return
            self.retries_admitted += int(attempt > 0)
            break
        if run.status != 200:
            self.rejected[ENGINE_REFUSED] = self.rejected.get(ENGINE_REFUSED, 0) + 1
            return
        self.completed += 1
        self.shared_tokens += record.shared_tokens or 0
        self.resident_per_request.append(self.gate.ledger_tokens(spec.prompt_tokens
                                                                 + run.generated))
        if run.first_token_s is not None:
            ttft = run.first_token_s - arrival
            self.ttfts.append(ttft)
            if ttft <= s.ttft_slo_s:
                self.good += 1

    def _engine_hashes(self, spec: TraceRequest) -> list[int] | None:
        if not spec.hash_ids:
            return None
        return block_hashes_from_hash_ids(spec.hash_ids, hash_id_tokens=HASH_ID_TOKENS,
                                          block_size=self.s.block_size,
                                          prompt_tokens=spec.prompt_tokens)

    def _ledger_keys(self, spec: TraceRequest) -> tuple[str, ...]:
        """The ledger's keys of the prompt's shareable blocks: the engine's own block
        hashes (one process, so Python's hash of ints is stable here), in 16 hex digits."""
        hashes = self._engine_hashes(spec)
        if not hashes:
            return ()
        n = shareable_blocks(spec.prompt_tokens, self.s.block_size)
        return tuple(f"{h & 0xFFFF_FFFF_FFFF_FFFF:016x}" for h in hashes[:n])

    async def _run_in_engine(self, spec: TraceRequest, requested: int | None,
                             admitted: Admitted) -> _EngineRun:
        """The gate's send: the admitted request in its backend's simulated engine."""
        self.waits.append(admitted.record.queue_wait_ms / 1000)
        prompt = spec.prompt_tokens
        engine = self.engines[admitted.lease.backend.name]
        engine_max = requested if admitted.output_cap is None else admitted.output_cap
        # Without max_tokens a chat fills the context; with it, the engine stops there too.
        room = max(0, self.s.max_model_len - prompt)
        engine_max = room if engine_max is None else min(engine_max, room)
        if not engine.fits_ever(prompt, engine_max):
            return _EngineRun(status=400)
        sink = _StreamSink(admitted.progress, self.loop.time, admitted.lease.answered)
        engine.submit(prompt_tokens=prompt, max_tokens=engine_max, out=sink,
                      eos_after=spec.output_tokens, block_hashes=self._engine_hashes(spec))
        await sink.done
        if admitted.progress is not None:  # what the final usage chunk tells the tracker
            admitted.progress.tail += b'"usage":{"completion_tokens":%d}' % sink.generated
        first_byte = None if sink.first_token_s is None else sink.first_token_s
        return _EngineRun(status=200, first_byte_s=first_byte, first_token_s=sink.first_token_s,
                          generated=sink.generated)

    # ---------------------------------------------------------------- timers
    async def _read_engine(self, backend: Backend) -> EngineLoad:
        """What the engine's `/metrics` would say, from the engine object itself."""
        engine = self.engines[backend.name]
        return EngineLoad(usage_ratio=engine.blocks_used / engine.config.num_blocks,
                          preemptions_total=engine.preemptions,
                          prefix_caching=engine.config.prefix_caching,
                          block_size=engine.config.block_size,
                          prefix_hit_tokens_total=engine.prefix_cache_hits,
                          prefix_query_tokens_total=engine.prefix_cache_queries)

    async def run(self, requests: Sequence[TraceRequest]) -> SimReport:
        loop = self.loop
        for engine in self.engines.values():
            engine.start()
        timers = [loop.create_task(every(self.s.sample_interval_s, self._sample, "sampling")),
                  loop.create_task(self.gate.follow_engines(self._read_engine))]
        tasks: list[asyncio.Task[None]] = []
        t0 = loop.time()
        for spec in requests:
            delay = t0 + spec.arrival_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(loop.create_task(self.request(spec)))
        await asyncio.gather(*tasks)
        await self._sample()
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
                    "p95": round(quantile(values, 0.95) or 0.0, 4),
                    "peak": round(max(values), 4)}

        def pct(values: Sequence[float], qs: Iterable[float]) -> dict[str, float | None]:
            out: dict[str, float | None] = {}
            for q in qs:
                v = quantile(values, q)
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
            rejection_latency_s=pct(self.rejection_waits, (0.5, 0.9, 0.99)),
            ttft_s=pct(self.ttfts, (0.5, 0.99)),
            preemptions=sum(e.preemptions for e in self.engines.values()),
            ttft_slo_s=s.ttft_slo_s, goodput=self.good,
            goodput_ratio=round(self.good / n, 6) if n else 0.0,
            shared_prefix_tokens=self.shared_tokens,
            retries=self.retries, retries_admitted=self.retries_admitted,
            engine_prefix_hit_tokens=sum(e.prefix_cache_hits for e in self.engines.values()),
            engine_prefix_query_tokens=sum(e.prefix_cache_queries
                                           for e in self.engines.values()),
            timeline=self.timeline,
        )


def simulate(requests: Sequence[TraceRequest], scenario: Scenario) -> SimReport:
    """Replay `requests` against `scenario` in virtual time; deterministic for a trace."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(_Replay(scenario, loop).run(requests))
    finally:
        loop.close()
