"""One model's request pipeline, with no socket in it: count, decide, admit, send, release.

`Gate.handle` is a request's whole life, read top to bottom (the shape of GIE's
`Director.HandleRequest` and TGI's `validate` -> `Entry`):

    admitted = await self._admit(ask, record)   # count, demand, lease (or a rejection)
    self._follow(admitted)                      # adaptive: progress to resize from
    sent = await send(admitted)                 # the transport: HTTP, or a simulated engine
    ...the outcome, set in one place...
    finally: release exactly once; metrics and the log line once

The HTTP layer (`proxy.server`) turns headers into an `Ask` and forwards in `send`;
`kvgate simulate` (`proxy.replay`) hands in counted prompts and a `send` that runs a
simulated engine in virtual time. Both run this code: one demand, one admission, one
lease life, one engine-feedback step and one resize timer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace

from policies.engines import (
    PrefixSharing,
    caches_prefixes,
    counts_as_llama_cpp,
    requested_output,
)
from policies.ordering import make_ordering
from policies.placement import PlacementName
from policies.reservation import AdmissionTarget, ReservationMode
from proxy.admission import AdmissionController, Backend, Demand, Lease
from proxy.ask import Admitted, Ask, Record, S
from proxy.config import ModelConfig, QueueConfig
from proxy.count_workers import CountWorkers
from proxy.demand import DemandRule, ledger_rounding
from proxy.engine_feedback import EngineFeedback
from proxy.engine_metrics import EngineLoad
from proxy.errors import (
    ContextLengthExceeded,
    InternalError,
    InvalidRequest,
    KvgateError,
    RequestTooLarge,
)
from proxy.late_count import close_late, count_late, log_resize_failure
from proxy.ledger import Ledger
from proxy.metrics import Metrics, Outcome
from proxy.reservation import (
    Progress,
    ReservationTracker,
    follow_adaptively,
)
from proxy.sharing import counted_with_blocks, scope_of
from proxy.tickets import Tickets
from proxy.tokenize import CountFailed, PromptCounter, RenderedChat, TemplateError
from proxy.tokenize.chunked import CountExceeded
from proxy.tokenize.fair_pool import counting_for
from proxy.validation import Endpoint, ValidRequest

__all__ = ["Gate"]

_log = logging.getLogger("kvgate")

# Admission on a bound pays only where the event loop has idle time to hide the count
# in: with this many requests of the model in flight in this process it has none, and
# the bound would only add a resize (bench_peers: 2-4% less throughput at 16 and 64).
_BOUND_MAX_INFLIGHT = 4

# Outcomes of requests that were admitted or failed inside kvgate; every other outcome
# is a rejection's error code.
_ENDED = frozenset({Outcome.COMPLETED, Outcome.UPSTREAM_ERROR, Outcome.UPSTREAM_REFUSED,
                    Outcome.CLIENT_DISCONNECT, InternalError.code})


class Gate:
    """Count, decide, admit and follow the requests of one served model."""

    def __init__(
        self, config: ModelConfig, *, queue: QueueConfig, ledger: Ledger, metrics: Metrics,
        counter: PromptCounter | None, admit_on_bound: bool = False,
        on_lease: Callable[[str, Lease], None] | None = None, tickets: Tickets | None = None,
    ) -> None:
        self.config = config
        self.name = config.name
        self.counter = counter  # None: every ask comes counted (a replay)
        self.ledger = ledger
        self.metrics = metrics
        self.admit_on_bound = admit_on_bound and counter is not None
        self._kinds = tuple(b.kind for b in config.backends)
        self._as_llama_cpp = counts_as_llama_cpp(self._kinds)
        self.count_workers: CountWorkers | None = None  # set by the runtime once started
        self.tickets = tickets if tickets is not None else Tickets()
        self._on_lease = on_lease
        # Per layer kind, per request, and again on every resize: memoised, since a
        # model's layout never changes and lengths repeat.
        self.ledger_tokens: Callable[[int], int] = ledger_rounding(config)
        backends = [Backend(name=b.name, url=b.url, api_key=b.api_key, slots=b.slots,
                            capacity_tokens=config.capacity_tokens) for b in config.backends]
        self.controller: AdmissionController = controller_for(
            model=config.name, backends=backends, ledger=ledger, queue=queue,
            placement=config.placement, on_event=self._lease_event)
        for b in backends:
            metrics.backend_configured(b.name, b.capacity_tokens)
        # Shared prefixes are charged once where the layout is whole blocks of tokens
        # (not a hybrid model's token-equivalents) and the engine caches prefixes.
        dense = self.ledger_tokens(64 * config.block_size) == 64 * config.block_size
        self.prefix_sharing = config.prefix_sharing is PrefixSharing.AUTO and dense
        # by the engine's kind; its own report can turn that off, never on (below)
        self._kind_shares = {b.name: self.prefix_sharing and caches_prefixes(bc.kind)
                             for b, bc in zip(backends, config.backends, strict=True)}
        for b in backends:
            self.controller.set_shares_prefixes(b, self._kind_shares[b.name])
        self.tracker: ReservationTracker | None = None
        self.targets: dict[str, AdmissionTarget] = {}
        if config.reservation is ReservationMode.ADAPTIVE:
            a = config.adaptive
            self.tracker, self.targets = follow_adaptively(
                self.controller, quantile=a.quantile, min_samples=a.min_samples,
                history=a.history, resize_interval_s=a.resize_interval_s,
                ledger_tokens=self.ledger_tokens, block_size=config.block_size)
        self.demand_rule = DemandRule(config, self._kinds, self.tracker, self.ledger_tokens)
        self.feedback = EngineFeedback(
            name=self.name, adaptive=config.adaptive, block_size=config.block_size,
            controller=self.controller, ledger=ledger, metrics=metrics, tracker=self.tracker,
            targets=self.targets, prefix_sharing=self.prefix_sharing,
            kind_shares=self._kind_shares)

    @property
    def backends(self) -> list[Backend]:
        return self.controller.backends

    # ------------------------------------------------------------------ one request
    async def handle(self, ask: Ask, record: Record, send: Callable[[Admitted], Awaitable[S]]
                     ) -> S:
        """A request's life from counted to released; raises the contract's errors."""
        record.model = self.name
        admitted: Admitted | None = None
        sent: S | None = None
        outcome: str = Outcome.COMPLETED
        try:
            admitted = await self._admit(ask, record)
            self._follow(admitted, ask.request)
            sent = await send(admitted)
            if sent.first_byte_s is not None:
                self.metrics.first_byte(admitted.lease.backend.name, sent.first_byte_s)
            if sent.failed_mid_stream or sent.status >= 500:
                outcome = Outcome.UPSTREAM_ERROR
            elif sent.status >= 400:
                outcome = Outcome.UPSTREAM_REFUSED
            return sent
        except KvgateError as exc:  # a rejection before the lease, or the upstream's failure
            outcome = exc.reason
            if exc.status == 429 and exc.retryable:  # a place in line for its retry
                exc.ticket = self.tickets.issue(self.name, ask.tenant, exc.retry_after_s or 1.0)
                self.metrics.ticket_issued(self.name)
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            outcome = Outcome.CLIENT_DISCONNECT
            raise
        except BaseException:
            outcome = InternalError.code
            raise
        finally:
            if admitted is not None:
                completed = (outcome == Outcome.COMPLETED and sent is not None
                             and sent.status == 200)
                self._release(admitted, completed=completed)
            self.end(record, outcome)

    def end(self, record: Record, outcome: str) -> None:
        """The request's metrics and log line, once, whatever ended it."""
        if record.outcome is None:
            if outcome in _ENDED:
                self.metrics.finished(self.name, outcome)
            else:
                self.metrics.rejected(self.name, outcome)
        record.end(outcome)

    async def _admit(self, ask: Ask, record: Record) -> Admitted:
        """Count, decide the output budget, and hold a lease: at once on a bound, or
        after the exact count (queueing if needed), or a rejection."""
        req = ask.request
        t0 = time.perf_counter()
        counting_for.set(ask.tenant)  # the count pool's turns (this request's task only)
        if self._as_llama_cpp and req.chat is not None:
            chat = req.chat.as_llama_cpp_reads()  # the chat as the engine will render it
            if chat is not req.chat:
                req = replace(req, chat=chat)
                ask = replace(ask, request=req)
        if ask.prompt_tokens is None:
            self._refuse_what_never_fits(req)
        # Block keys come with the exact count (in this process, the pool or a count
        # worker), before admission; on a bound only where they lose nothing there.
        sharing = any(b.shares_prefixes for b in self.backends)
        rendered = self._render(ask) if not sharing or self._keys_may_come_late(req) else None
        if rendered is not None and self._may_admit_on_bound(req, rendered):
            assert rendered.max_tokens is not None
            early = await self._admit_on_bound(ask, record, rendered, rendered.max_tokens,
                                               keyed=sharing)
            if early is not None:
                return early
        blocks = ask.blocks
        if ask.prompt_tokens is not None:
            prompts = list(ask.prompt_tokens)
        else:
            limit = self.config.max_model_len - 1  # a longer prompt leaves no room
            try:
                shared = await self._count_shared(req, limit) if sharing else None
                if shared is not None:
                    prompts, blocks = _nonempty([shared[0]]), shared[1]
                elif rendered is not None:
                    prompts = _nonempty([await self._counter.count_rendered_async(
                        rendered, limit)])
                else:
                    prompts = await self._count(req, ask.raw, limit)
            except CountExceeded as exc:  # counting stopped: it could never be admitted
                self.metrics.counted(self.name, prompt_tokens=exc.at_least,
                                     seconds=time.perf_counter() - t0)
                raise ContextLengthExceeded(
                    max_model_len=self.config.max_model_len, prompt_tokens=exc.at_least,
                    max_tokens=0, counted_to=True) from None
            except CountFailed as exc:  # what no tokenizer here can count exactly
                self.metrics.count_failed(self.name)
                _log.warning("request %s: %s", record.request_id, exc)
                raise InternalError(
                    f"kvgate could not count this request's prompt exactly (request id "
                    f"{record.request_id}); it was not admitted and reached no backend"
                ) from exc
            self.metrics.counted(self.name, prompt_tokens=sum(prompts),
                                 seconds=time.perf_counter() - t0)
        record.prompt_tokens = sum(prompts)
        keyed = blocks if blocks and req.n == 1 and len(prompts) == 1 else ()
        demand, output_cap = self.demand(req, prompts, priority=ask.priority, tenant=ask.tenant,
                                         blocks=keyed, block_tokens=self.config.block_size)
        if ask.ticket is not None and self.tickets.redeem(ask.ticket, self.name, ask.tenant):
            demand = replace(demand, held_place=True)
            record.held_place = True
            self.metrics.ticket_redeemed(self.name)
        record.reserved_tokens = demand.tokens
        loop = asyncio.get_running_loop()
        queued_at = loop.time()
        try:
            lease = await self.controller.acquire(demand, ask.deadline)
        finally:
            record.queue_wait_ms = (loop.time() - queued_at) * 1000
            self.metrics.queue_depth(self.name, self.controller.queue_depth)
        if demand.blocks:  # what was charged, and what shared blocks covered
            record.reserved_tokens = demand.tokens - lease.shared_tokens
            record.shared_tokens = lease.shared_tokens
            self.metrics.shared_prefix(lease.backend.name, lease.shared_tokens)
        self.metrics.admitted(self.name, reserved_tokens=record.reserved_tokens,
                              waited_s=record.queue_wait_ms / 1000)
        return self._admitted(lease, demand, output_cap, ask, record)

    def _admitted(self, lease: Lease, demand: Demand, output_cap: int | None, ask: Ask,
                  record: Record) -> Admitted:
        record.backend = lease.backend.name
        record.output_cap = output_cap
        body = ask.raw if output_cap is None else ask.request.with_max_tokens(output_cap)
        return Admitted(lease=lease, demand=demand, body=body, output_cap=output_cap,
                        record=record)

    def _follow(self, admitted: Admitted, req: ValidRequest) -> None:
        if self.tracker is None:
            return
        d = admitted.demand
        admitted.progress = Progress(
            lease=admitted.lease, prompt_tokens=d.prompt_tokens, max_tokens=d.max_tokens,
            n=d.n, min_tokens=d.min_tokens, stream=req.stream,
            chat=req.endpoint is Endpoint.CHAT, started_s=asyncio.get_running_loop().time())
        self.tracker.track(admitted.progress)

    def _release(self, admitted: Admitted, *, completed: bool) -> None:
        try:
            if (settling := admitted.settling) is not None:
                if not settling.done():
                    settling.cancel()  # the reply never began: the lease goes anyway
                elif not settling.cancelled():
                    settling.exception()  # retrieved: raised to the reply, or it never began
            if admitted.late_count is not None:
                close_late(admitted.late_count, admitted.record)
            if admitted.progress is not None and self.tracker is not None:
                self.tracker.finish(admitted.progress, asyncio.get_running_loop().time(),
                                    completed=completed)
        finally:
            admitted.lease.release()  # learning from the answer never stands in its way

    # ------------------------------------------------------------------ demand
    def demand(self, req: ValidRequest, prompts: list[int], *, priority: str = "",
               tenant: str = "", blocks: tuple[str, ...] = (),
               block_tokens: int = 0) -> tuple[Demand, int | None]:
        """What the request holds (`proxy.demand`); -> (demand, max_tokens to set)."""
        return self.demand_rule.of(req, prompts, priority=priority, tenant=tenant,
                                   blocks=blocks, block_tokens=block_tokens)

    def _refuse_what_never_fits(self, req: ValidRequest) -> None:
        """What parsing alone decides, before any counting: every prompt holds at least
        one token and one output token per sequence, block-rounded, so a body of more
        prompts than the largest backend could hold that way is refused at once (a
        million one-word prompts costs seconds to count and can never be admitted)."""
        self.demand_rule.refuse_output_over_context(req)
        prompts = 1 if req.chat is not None else len(req.prompts)
        least = self.demand_rule.least_tokens(req)
        largest = self.controller.max_capacity_tokens
        if least > largest:
            raise RequestTooLarge(
                f"{prompts} prompt(s) x n={req.n} hold at least {least} tokens, more than the "
                f"largest backend capacity {largest} tokens of model {self.name!r}; it can "
                "never be admitted", param="prompt")

    # ------------------------------------------------------------------ counting
    @property
    def _counter(self) -> PromptCounter:
        if self.counter is None:
            raise RuntimeError(f"model {self.name!r} has no counter: asks must come counted")
        return self.counter

    async def _count(self, req: ValidRequest, raw: bytes, limit: int) -> list[int]:
        """Exact counts: in a count worker where they run, else in this process; either
        way counting stops once a prompt passes `limit` (`CountExceeded`)."""
        counter, workers = self._counter, self.count_workers
        try:
            counts: list[int] | None = None
            if workers is not None and (req.chat is not None
                                        or any(isinstance(p, str) for p in req.prompts)):
                counts = await workers.count(req.endpoint, raw, limit)
            if counts is None:
                if req.chat is not None:
                    counts = [await counter.count_chat_async(req.chat, limit)]
                else:
                    counts = [await counter.count_prompt_async(p, limit) for p in req.prompts]
        except TemplateError as exc:
            raise InvalidRequest(str(exc), param="messages") from exc
        return _nonempty(counts)

    async def _count_shared(self, req: ValidRequest, limit: int
                            ) -> tuple[int, tuple[str, ...]] | None:
        """The exact count and block keys from one id stream (`proxy.sharing`): in a
        count worker where they run, else in this process."""
        try:
            return await counted_with_blocks(self._counter, req, self.config.block_size,
                                             scope_of(self.name, req), self.count_workers,
                                             limit=limit)
        except TemplateError as exc:
            raise InvalidRequest(str(exc), param="messages") from exc

    def _render(self, ask: Ask) -> RenderedChat | None:
        """The rendered chat, where it is counted in this process from its rendered text:
        a chat with nothing counted yet and no count workers to send it to."""
        req = ask.request
        if req.chat is None or ask.prompt_tokens is not None or self.count_workers is not None:
            return None
        try:
            return self._counter.render_for_count(req.chat)
        except TemplateError as exc:
            raise InvalidRequest(str(exc), param="messages") from exc

    def _keys_may_come_late(self, req: ValidRequest) -> bool:
        """With prefix sharing, whether a request may be admitted on a bound, before its
        block keys are counted: where they decide nothing yet. Placement has no choice
        (one healthy backend) and nothing is held there to join (no shared blocks: with
        Redis, as this replica knows it); it is charged its whole prompt, and its keys
        are registered once counted (`_settle`), shared from its answer on. (Checked
        before the chat is rendered for a bound: a request that cannot take one is
        rendered once, by the count with keys.)"""
        if (not self.admit_on_bound or self.controller.inflight >= _BOUND_MAX_INFLIGHT
                or requested_output(self._kinds, max_tokens=req.max_tokens,
                                    n_predict=req.n_predict) is None):
            return False
        healthy = [b for b in self.backends if b.healthy]
        return len(healthy) == 1 and self.ledger.shared_resident(healthy[0].name) == 0

    def _may_admit_on_bound(self, req: ValidRequest, rendered: RenderedChat) -> bool:
        """A proven bound, a client-set max_tokens (so the output decision needs no exact
        prompt), the switch on, and idle loop time to hide the late count in."""
        asked = requested_output(self._kinds, max_tokens=req.max_tokens,
                                 n_predict=req.n_predict)
        return (bool(rendered.max_tokens) and self.admit_on_bound and asked is not None
                and self.controller.inflight < _BOUND_MAX_INFLIGHT)

    async def _admit_on_bound(self, ask: Ask, record: Record, rendered: RenderedChat,
                              bound: int, *, keyed: bool) -> Admitted | None:
        """Admit at once on `bound` (>= the exact prompt count) where that needs no exact
        figure: the client set max_tokens, so the output decision does not depend on the
        prompt; prompt <= bound, so the context check passes for the exact count too; and
        the controller has room now with nobody waiting. Else None: count first.
        """
        try:
            demand, output_cap = self.demand(ask.request, [bound], priority=ask.priority,
                                             tenant=ask.tenant)
        except ContextLengthExceeded:
            return None  # only the exact count can say
        lease = await self.controller.try_acquire(demand)
        if lease is None:
            return None
        record.reserved_tokens = demand.tokens
        self.metrics.admitted_on_bound(self.name)
        admitted = self._admitted(lease, demand, output_cap, ask, record)
        loop = asyncio.get_running_loop()
        admitted.late_count = loop.create_task(
            count_late(self._counter, rendered, block_tokens=self.config.block_size,
                       scope=scope_of(self.name, ask.request),
                       keyed=ask.request if keyed else None))
        admitted.settling = loop.create_task(self._settle(ask, admitted))
        return admitted

    async def _settle(self, ask: Ask, admitted: Admitted) -> None:
        """The exact count of a request admitted on a bound: into the record, the metrics
        and the tracker; the lease shrinks to it as soon as it is in, without holding up
        the forward (the reply's headers wait for it, so they report it)."""
        assert admitted.late_count is not None
        try:
            tokens, seconds, keys = await admitted.late_count
        except CountFailed as exc:  # the bound is a true upper bound: the lease stays on it
            self.metrics.count_failed(self.name)
            _log.warning("request %s: the exact count failed; it holds its bound of %d "
                         "tokens: %s", admitted.record.request_id, admitted.demand.tokens, exc)
            return
        prompts = _nonempty([tokens])
        record = admitted.record
        record.prompt_tokens = tokens
        self.metrics.counted(self.name, prompt_tokens=tokens, seconds=seconds)
        demand, _ = self.demand(ask.request, prompts, priority=ask.priority,
                                tenant=ask.tenant)  # prompt <= bound: it fits
        record.reserved_tokens = demand.tokens
        self.metrics.admitted(self.name, reserved_tokens=demand.tokens, waited_s=0.0)
        if admitted.progress is not None:
            admitted.progress.prompt_tokens = tokens
        lease = admitted.lease
        if keys:  # charged in full, as a lease that found nothing to share; its blocks
            # registered before the answer begins, so they are ready from its first byte
            record.shared_tokens = 0
            await self.controller.attach(lease, keys, self.config.block_size)
            self.metrics.shared_prefix(lease.backend.name, 0)
        if demand.tokens != lease.tokens:
            resize = asyncio.ensure_future(self.controller.resize(lease, demand.tokens))
            resize.add_done_callback(log_resize_failure)

    # ------------------------------------------------------------------ following
    async def follow_engines(
        self, read_engine: Callable[[Backend], Awaitable[EngineLoad | None]]
    ) -> None:
        """Until cancelled: the resize timer and the engines' reports
        (`proxy.engine_feedback`)."""
        await self.feedback.follow(read_engine)

    def engine_report(self, backend: Backend, load: EngineLoad, now: float) -> None:
        self.feedback.report(backend, load, now)

    def _lease_event(self, kind: str, lease: Lease | None) -> None:
        if lease is None:
            return
        b = lease.backend
        self.metrics.backend_state(b.name, resident=self.ledger.resident(b.name),
                                   capacity=b.capacity_tokens, inflight=b.inflight)
        if self._on_lease is not None:
            self._on_lease(kind, lease)


def _nonempty(counts: list[int]) -> list[int]:
    for i, tokens in enumerate(counts):
        if tokens == 0:  # vLLM refuses an empty decoder prompt; it must not reach it
            where = "prompt" if len(counts) == 1 else f"prompt[{i}]"
            raise InvalidRequest(
                f"`{where}` is empty: 0 tokens after tokenization, and an engine cannot "
                "generate from an empty prompt", param=where)
    return counts


def controller_for(
    *, model: str, backends: Sequence[Backend], ledger: Ledger, queue: QueueConfig,
    placement: PlacementName, on_event: Callable[[str, Lease | None], None] | None = None,
) -> AdmissionController:
    """A model's controller with the `[queue]` settings: the proxy and `kvgate simulate`
    both build it here (through the gate), so a simulated deployment queues exactly as
    a served one."""
    return AdmissionController(
        model=model, backends=backends, ledger=ledger,
        ordering=make_ordering(queue.ordering, weights=queue.tenant_weights,
                               aging_tokens_per_s=queue.aging_tokens_per_s,
                               half_life_s=queue.fair_share_half_life_s),
        placement=placement, max_queue_depth=queue.max_depth,
        max_depth_by_priority=queue.max_depth_by_priority,
        starvation_s=queue.starvation_s, on_event=on_event,
    )
