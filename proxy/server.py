"""HTTP routes and wiring: parse, call the core, serialize. Nothing is decided here.

Request path: read (size-limited) -> validate -> resolve model -> count (inline, thread
pool, or count workers) -> output policy and context check -> demand -> acquire (reserve
or queue) -> forward -> release in `finally`, exactly once, on every path.

While nothing waits, a chat with a proven bound on its prompt is admitted on the bound
and counted while the forward is on its way (`_admit_on_bound`, `_settle`): the same
steps, with the count moved behind the send.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import itertools
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from policies.engines import default_output_tokens
from policies.output import decide_output
from policies.reservation import AdmissionTarget, ReservationMode
from proxy.admission import AdmissionController, Backend, Demand, Lease, controller_for
from proxy.capacity import cdiv
from proxy.config import KvgateConfig, ModelConfig
from proxy.count_workers import CountWorkers
from proxy.engine_metrics import engine_load, kv_capacity_tokens
from proxy.errors import (
    ContextLengthExceeded,
    InternalError,
    InvalidRequest,
    KvgateError,
    MaxTokensRequired,
    MethodNotAllowed,
    ModelNotFound,
    NotFound,
    RequestTooLarge,
    Unauthorized,
    UpstreamError,
)
from proxy.forward import ForwardResult, forward, make_session
from proxy.ledger import Ledger, MemoryLedger
from proxy.metrics import CONTENT_TYPE, Metrics, Outcome
from proxy.reservation import (
    Progress,
    ReservationTracker,
    apply_engine_report,
    follow_adaptively,
)
from proxy.tokenize import PromptCounter, RenderedChat, TemplateError, load_counter
from proxy.tokenize.cache import CacheStats
from proxy.validation import Endpoint, ValidRequest, validate

__all__ = ["ProxyState", "build_app", "start_proxy"]

log = logging.getLogger("kvgate.request")



class ModelRuntime:
    """A served model: its counter, its config and its admission controller."""

    def __init__(self, config: ModelConfig, controller: AdmissionController) -> None:
        self.config = config
        self.counter: PromptCounter = load_counter(config.path, name=config.name)
        self.controller = controller
        # Per layer kind, per request, and again on every resize: memoised, since a
        # model's layout never changes and lengths repeat.
        self.ledger_tokens: Callable[[int], int] = functools.lru_cache(maxsize=16384)(
            self._ledger_tokens)
        self.tracker: ReservationTracker | None = None
        self.targets: dict[str, AdmissionTarget] = {}
        if config.reservation is ReservationMode.ADAPTIVE:
            a = config.adaptive
            self.tracker, self.targets = follow_adaptively(
                controller, quantile=a.quantile, min_samples=a.min_samples, history=a.history,
                resize_interval_s=a.resize_interval_s, ledger_tokens=self.ledger_tokens,
                block_size=config.block_size)

    def _ledger_tokens(self, resident_tokens: int) -> int:
        """Block-rounded ledger tokens (token-equivalents for hybrid layouts)."""
        if self.config.deployment is not None:
            return self.config.deployment.ledger_tokens(resident_tokens)
        return cdiv(resident_tokens, self.config.block_size) * self.config.block_size


class ProxyState:
    def __init__(self, config: KvgateConfig, ledger: Ledger, metrics: Metrics) -> None:
        self.config = config
        self.ledger = ledger
        self.metrics = metrics
        self.models: dict[str, ModelRuntime] = {}
        self.session: aiohttp.ClientSession | None = None
        self.count_workers: CountWorkers | None = None
        for mc in config.models:
            backends = [
                Backend(name=b.name, url=b.url, api_key=b.api_key,
                        capacity_tokens=mc.capacity_tokens)
                for b in mc.backends
            ]
            controller = controller_for(model=mc.name, backends=backends, ledger=ledger,
                                        queue=config.queue, placement=mc.placement,
                                        on_event=self._on_lease_event)
            self.models[mc.name] = ModelRuntime(mc, controller)
            for b in backends:
                metrics.backend_configured(b.name, b.capacity_tokens)
                b.healthy = b.capacity_tokens > 0  # unknown capacity: not ready yet

    def _on_lease_event(self, kind: str, lease: Lease | None) -> None:
        if lease is None:
            return
        b = lease.backend
        self.metrics.backend_state(
            b.name, resident=self.ledger.resident(b.name), capacity=b.capacity_tokens,
            inflight=b.inflight,
        )

    def backends(self) -> list[Backend]:
        return [b for m in self.models.values() for b in m.controller.backends]


STATE_KEY = web.AppKey("state", ProxyState)


@dataclass(slots=True)
class _Trace:
    """Per-request facts for headers, metrics and the log line."""

    request_id: str
    model: str = "-"
    backend: str = "-"
    prompt_tokens: int | None = None
    reserved_tokens: int | None = None
    queue_wait_ms: float = 0.0
    output_cap: int | None = None
    outcome: str = Outcome.COMPLETED

    def headers(self) -> dict[str, str]:
        out = {"x-kvgate-queue-wait-ms": f"{self.queue_wait_ms:.1f}",
               "x-kvgate-request-id": self.request_id}
        if self.prompt_tokens is not None:
            out["x-kvgate-prompt-tokens"] = str(self.prompt_tokens)
        if self.reserved_tokens is not None:
            out["x-kvgate-reserved-tokens"] = str(self.reserved_tokens)
        if self.output_cap is not None:
            out["x-kvgate-output-cap"] = str(self.output_cap)
        return out


_ENDED = frozenset({Outcome.COMPLETED, Outcome.UPSTREAM_ERROR, Outcome.CLIENT_DISCONNECT,
                    InternalError.code})
# Set by `error_middleware` for the task that serves the request, so the id in a 500's
# message is the one `_infer` logs (a ContextVar: no request-storage key to declare).
_REQUEST_ID: ContextVar[str | None] = ContextVar("kvgate_request_id", default=None)


def _error_response(
    state: ProxyState, exc: KvgateError, trace: _Trace | None, *, request_id: str | None = None
) -> web.Response:
    """The one place a `KvgateError` becomes an HTTP answer."""
    headers = exc.headers()
    if request_id is not None:
        headers["x-kvgate-request-id"] = request_id
    if trace is not None:
        headers.update(trace.headers())
        trace.outcome = exc.code
        # an upstream or internal failure is not a rejection: `_infer` counts it as ended
        if not isinstance(exc, UpstreamError | InternalError) and trace.model in state.models:
            state.metrics.rejected(trace.model, exc.code)
    return web.json_response(exc.to_body(), status=exc.status, headers=headers)


def _http_error(request: web.Request, exc: web.HTTPException) -> KvgateError | None:
    """aiohttp's router answers unknown paths and methods in plain text; say it in the
    contract instead. Other HTTP exceptions pass through as aiohttp renders them."""
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return MethodNotAllowed(
            f"method {request.method} is not allowed on {request.path}; allowed: "
            f"{', '.join(sorted(exc.allowed_methods))}",
            allowed=exc.allowed_methods,
        )
    if isinstance(exc, web.HTTPNotFound):
        return NotFound(
            f"no route {request.method} {request.path}; kvgate serves POST "
            "/v1/chat/completions, POST /v1/completions and GET /v1/models",
        )
    return None


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


_REQUEST_ID_PREFIX = secrets.token_hex(4)  # per process: ids stay unique across replicas
_request_seq = itertools.count()


def _next_request_id() -> str:
    """16 hex digits: a random per-process prefix and a counter (no syscall per request)."""
    return f"{_REQUEST_ID_PREFIX}{next(_request_seq) & 0xFFFFFFFF:08x}"


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every answer follows the error contract: errors raised outside the inference path
    (no trace), unknown routes and methods, and, as the last resort, any exception
    nothing mapped, which becomes `500 internal_error` naming the request id that the
    log line with its traceback carries. A lease is never held here: `_serve` releases
    in its `finally` before the exception arrives."""
    request_id = _next_request_id()
    _REQUEST_ID.set(request_id)
    state = request.app[STATE_KEY]
    try:
        return await handler(request)
    except KvgateError as exc:
        return _error_response(state, exc, None, request_id=request_id)
    except web.HTTPException as exc:
        mapped = _http_error(request, exc)
        if mapped is None:
            raise
        return _error_response(state, mapped, None, request_id=request_id)
    except Exception as exc:
        if isinstance(exc, ConnectionResetError) and _client_gone(request):
            # No one to answer; `_serve` counted the outcome. aiohttp drops this quietly.
            return web.Response(status=499)
        log.exception("request %s %s %s failed with an unexpected error", request_id,
                      request.method, request.path)
        if request.writer.output_size > 0:
            raise  # the answer began: aiohttp cuts the connection; never a second answer
        error = InternalError(
            f"kvgate failed on this request with an internal error (request id "
            f"{request_id}); it is logged with its cause"
        )
        return _error_response(state, error, None, request_id=request_id)


async def _read_body(request: web.Request, limit: int) -> bytes:
    declared = request.content_length
    if declared is not None and declared > limit:
        raise RequestTooLarge(
            f"request body is {declared} bytes; the limit is {limit} bytes", param="body"
        )
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.content.iter_chunked(1 << 16):
            size += len(chunk)
            if size > limit:
                raise RequestTooLarge(
                    f"request body exceeds the limit of {limit} bytes", param="body"
                )
            chunks.append(chunk)
    except web.RequestPayloadError as exc:  # e.g. `Content-Encoding: gzip` on a plain body
        # The rest of the body cannot be parsed either: end it here, answer, and close
        # the connection (`_infer`), rather than let aiohttp drain a failed payload.
        request.content.feed_eof()
        raise InvalidRequest(f"the request body could not be read: {exc}", param="body") from exc
    return b"".join(chunks)


def _deadline(request: web.Request, state: ProxyState) -> float:
    q = state.config.queue
    wait_s = q.default_deadline_s
    header = request.headers.get("x-kvgate-deadline-ms")
    if header is not None:
        try:
            asked = float(header) / 1000
        except ValueError:
            raise InvalidRequest(
                f"`x-kvgate-deadline-ms` must be a number of milliseconds. Given: {header!r}",
                param="x-kvgate-deadline-ms",
            ) from None
        if not asked >= 0:
            raise InvalidRequest("`x-kvgate-deadline-ms` must be >= 0",
                                 param="x-kvgate-deadline-ms")
        wait_s = asked  # clients may shorten, never lengthen past the maximum
    return asyncio.get_running_loop().time() + min(wait_s, q.max_deadline_s)


def _tenant(request: web.Request, state: ProxyState) -> str:
    """A hash of the API key; the tenant header only where the operator trusts it
    (`queue.trust_tenant_header`): any client can set a header to any name."""
    if state.config.queue.trust_tenant_header:
        tenant = request.headers.get(state.config.queue.tenant_header)
        if tenant:
            return tenant[:64]
    auth = request.headers.get("Authorization", "")
    # surrogateescape: aiohttp decodes header bytes that are not UTF-8 (obs-text) so
    return hashlib.sha256(auth.encode("utf-8", "surrogateescape")).hexdigest()[:12] if auth else ""


def _priority(request: web.Request, state: ProxyState) -> str:
    """The class an API key is configured to, else what the priority header says."""
    q = state.config.queue
    key = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    if key and key in q.priority_by_api_key:
        return q.priority_by_api_key[key]
    return request.headers.get(q.priority_header, "")[:32]


async def _count(
    state: ProxyState, model: ModelRuntime, req: ValidRequest, raw: bytes
) -> list[int]:
    workers = state.count_workers
    try:
        counts: list[int] | None = None
        if workers is not None and (req.chat is not None
                                    or any(isinstance(p, str) for p in req.prompts)):
            counts = await workers.count(req.endpoint, raw)
        if counts is None:
            if req.chat is not None:
                counts = [await model.counter.count_chat_async(req.chat)]
            else:
                counts = [await model.counter.count_prompt_async(p) for p in req.prompts]
    except TemplateError as exc:
        raise InvalidRequest(str(exc), param="messages") from exc
    return _nonempty(counts)


def _demand(
    model: ModelRuntime, req: ValidRequest, prompts: list[int], request: web.Request,
    state: ProxyState,
) -> tuple[Demand, int | None]:
    """Output reservation and context check per prompt; -> (demand, max_tokens to set).

    The body carries one max_tokens for all its prompts: when the output policy caps
    any of them, every prompt is forwarded with that cap, so every prompt reserves it
    and must fit the context with it.
    """
    cfg = model.config
    min_tokens = req.min_tokens
    # Several prompts in one call: one lease, several sequences; follow none of them.
    strict = req.ignore_eos or len(prompts) > 1 or model.tracker is None
    decisions = []
    for prompt_tokens in prompts:
        engine_default = default_output_tokens(
            (b.kind for b in cfg.backends), chat=req.endpoint is Endpoint.CHAT,
            prompt_tokens=prompt_tokens, max_model_len=cfg.max_model_len)
        decision = decide_output(cfg.output, requested=req.max_tokens,
                                 engine_default=engine_default)
        if decision.missing:
            raise MaxTokensRequired(
                f"model {cfg.name!r} requires `max_tokens` (or `max_completion_tokens`): "
                "kvgate reserves KV cache for every output token a request may generate",
                param="max_tokens",
            )
        decisions.append(decision)
    set_to = next((d.set_max_tokens for d in decisions if d.set_max_tokens is not None), None)
    total = 0
    reserve_out = 0
    for prompt_tokens, decision in zip(prompts, decisions, strict=True):
        out = decision.max_tokens if set_to is None else set_to
        if prompt_tokens + out > cfg.max_model_len or out < 1:
            raise ContextLengthExceeded(
                max_model_len=cfg.max_model_len, prompt_tokens=prompt_tokens, max_tokens=out,
            )
        reserve_out = max(reserve_out, out)
        if model.tracker is not None:
            total += model.tracker.lease_tokens(
                prompt_tokens=prompt_tokens, max_tokens=out, n=req.n,
                min_tokens=min(min_tokens, out), strict=strict,
            )
        else:
            total += req.n * model.ledger_tokens(prompt_tokens + out)
    demand = Demand(tokens=total, prompt_tokens=sum(prompts), max_tokens=reserve_out, n=req.n,
                    priority=_priority(request, state), tenant=_tenant(request, state),
                    min_tokens=min(min_tokens, reserve_out), follow=not strict)
    return demand, set_to


async def _infer(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    trace = _Trace(request_id=_REQUEST_ID.get() or _next_request_id())
    started = time.perf_counter()
    try:
        return await _serve(request, endpoint, state, trace)
    except KvgateError as exc:
        response = _error_response(state, exc, trace)
        if request.content.exception() is not None:  # a body the parser failed on
            response.force_close()
        return response
    except ConnectionResetError:
        raise  # the client left; `_serve` set the outcome
    except Exception:
        trace.outcome = InternalError.code  # answered by `error_middleware`
        raise
    finally:
        if trace.model in state.models and trace.outcome in _ENDED:
            state.metrics.finished(trace.model, trace.outcome)
        if log.isEnabledFor(logging.INFO):
            log.info(json.dumps({
                "id": trace.request_id, "model": trace.model, "backend": trace.backend,
                "prompt_tokens": trace.prompt_tokens, "reserved_tokens": trace.reserved_tokens,
                "queue_wait_ms": round(trace.queue_wait_ms, 1), "outcome": str(trace.outcome),
                "duration_ms": round((time.perf_counter() - started) * 1000, 1),
            }))


# Admission on a bound pays only where the event loop has idle time to hide the count
# in: with this many requests of the model in flight in this process it has none, and
# the bound would only add a resize (bench_peers: 2-4% less throughput at 16 and 64).
_BOUND_MAX_INFLIGHT = 4


@dataclass(slots=True)
class _LateCount:
    """A request admitted on an upper bound of its prompt while nothing waited: its
    exact count runs while the backend starts on the request, and `settle` puts the
    exact figures in the lease, the tracker and the headers before the reply leaves."""

    task: asyncio.Task[tuple[int, float]]
    resize: asyncio.Task[int] | None = None


@dataclass(slots=True)
class _Admitted:
    lease: Lease
    demand: Demand
    set_to: int | None
    late: _LateCount | None = None


def _nonempty(counts: list[int]) -> list[int]:
    for i, tokens in enumerate(counts):
        if tokens == 0:  # vLLM refuses an empty decoder prompt; it must not reach it
            where = "prompt" if len(counts) == 1 else f"prompt[{i}]"
            raise InvalidRequest(
                f"`{where}` is empty: 0 tokens after tokenization, and an engine cannot "
                "generate from an empty prompt", param=where)
    return counts


async def _count_rendered(model: ModelRuntime, rendered: RenderedChat) -> tuple[int, float]:
    # Created before the forward, so first in the loop's queue: step aside once, and
    # aiohttp's body-writing task (created as the forward sends its headers) runs
    # first; the request is on the wire while this counts.
    await asyncio.sleep(0)
    t0 = time.perf_counter()
    tokens = await model.counter.count_rendered_async(rendered)
    return tokens, time.perf_counter() - t0


async def _admit_on_bound(
    request: web.Request, state: ProxyState, model: ModelRuntime, req: ValidRequest,
    rendered: RenderedChat, bound: int, trace: _Trace,
) -> _Admitted | None:
    """Admit at once on `bound` (>= the exact prompt count) where that needs no exact
    figure: the client set max_tokens, so the output decision does not depend on the
    prompt; prompt <= bound, so the context check passes for the exact count too; and
    the controller has room now with nobody waiting. Else None: the caller counts first.
    """
    try:
        demand, set_to = _demand(model, req, [bound], request, state)
    except ContextLengthExceeded:
        return None  # only the exact count can say
    lease = await model.controller.try_acquire(demand)
    if lease is None:
        return None
    trace.reserved_tokens = demand.tokens
    state.metrics.admitted_on_bound(model.config.name)
    task = asyncio.get_running_loop().create_task(_count_rendered(model, rendered))
    return _Admitted(lease, demand, set_to, _LateCount(task))


async def _admit(
    request: web.Request, state: ProxyState, model: ModelRuntime, req: ValidRequest,
    raw: bytes, trace: _Trace,
) -> _Admitted:
    """Count, decide the output budget, and hold a lease: at once on a bound, or after
    the exact count (queueing if needed), or an error."""
    t0 = time.perf_counter()
    rendered: RenderedChat | None = None
    if req.chat is not None and state.count_workers is None:
        try:
            rendered = model.counter.render_for_count(req.chat)
        except TemplateError as exc:
            raise InvalidRequest(str(exc), param="messages") from exc
    if (rendered is not None and rendered.max_tokens and req.max_tokens is not None
            and state.config.server.admit_on_bound
            and model.controller.inflight < _BOUND_MAX_INFLIGHT):
        early = await _admit_on_bound(request, state, model, req, rendered,
                                      rendered.max_tokens, trace)
        if early is not None:
            return early
    if rendered is not None:
        prompts = _nonempty([await model.counter.count_rendered_async(rendered)])
    else:
        prompts = await _count(state, model, req, raw)
    trace.prompt_tokens = sum(prompts)
    state.metrics.counted(model.config.name, prompt_tokens=trace.prompt_tokens,
                          seconds=time.perf_counter() - t0)
    demand, set_to = _demand(model, req, prompts, request, state)
    trace.reserved_tokens = demand.tokens
    deadline = _deadline(request, state)
    controller = model.controller
    queued_at = asyncio.get_running_loop().time()
    try:
        lease = await controller.acquire(demand, deadline)
    except asyncio.CancelledError:
        trace.outcome = Outcome.CLIENT_DISCONNECT
        raise
    finally:
        trace.queue_wait_ms = (asyncio.get_running_loop().time() - queued_at) * 1000
        state.metrics.queue_depth(model.config.name, controller.queue_depth)
    state.metrics.admitted(model.config.name, reserved_tokens=demand.tokens,
                           waited_s=trace.queue_wait_ms / 1000)
    return _Admitted(lease, demand, set_to)


async def _settle(
    request: web.Request, state: ProxyState, model: ModelRuntime, req: ValidRequest,
    admitted: _Admitted, progress: Progress | None, trace: _Trace,
) -> None:
    """The exact count of a request admitted on a bound: into the headers, the metrics
    and the tracker; the lease shrinks to it without holding up the reply."""
    late = admitted.late
    assert late is not None
    tokens, seconds = await late.task
    prompts = _nonempty([tokens])
    trace.prompt_tokens = tokens
    state.metrics.counted(model.config.name, prompt_tokens=tokens, seconds=seconds)
    demand, _ = _demand(model, req, prompts, request, state)  # prompt <= bound: it fits
    trace.reserved_tokens = demand.tokens
    state.metrics.admitted(model.config.name, reserved_tokens=demand.tokens, waited_s=0.0)
    if progress is not None:
        progress.prompt_tokens = tokens
    lease = admitted.lease
    if demand.tokens != lease.tokens:
        late.resize = asyncio.ensure_future(model.controller.resize(lease, demand.tokens))
        late.resize.add_done_callback(_log_failure)


def _log_failure(task: asyncio.Task[int]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.warning("a lease's resize to its exact count failed: %s", exc)


def _close_late(late: _LateCount, trace: _Trace) -> None:
    """On every way out: a count still running (the reply never began: upstream error,
    client gone) is stopped; a finished one is read, so its outcome is never left
    unretrieved, and its count goes to the log line."""
    if not late.task.done():
        late.task.cancel()
    elif not late.task.cancelled() and late.task.exception() is None:
        trace.prompt_tokens = late.task.result()[0]


async def _serve(
    request: web.Request, endpoint: Endpoint, state: ProxyState, trace: _Trace
) -> web.StreamResponse:
    raw = await _read_body(request, state.config.server.body_limit_bytes)
    req = validate(raw, endpoint)
    model = state.models.get(req.model)
    if model is None:
        raise ModelNotFound(
            f"The model `{req.model}` does not exist. Served models: {sorted(state.models)}",
            param="model",
        )
    trace.model = model.config.name
    admitted = await _admit(request, state, model, req, raw, trace)
    lease, demand, set_to = admitted.lease, admitted.demand, admitted.set_to
    trace.output_cap = set_to
    loop = asyncio.get_running_loop()
    progress: Progress | None = None
    result = ForwardResult()
    try:
        if model.tracker is not None:
            progress = Progress(
                lease=lease, prompt_tokens=demand.prompt_tokens, max_tokens=demand.max_tokens,
                n=req.n, min_tokens=demand.min_tokens, strict=not demand.follow,
                stream=req.stream,
                chat=req.endpoint is Endpoint.CHAT, started_s=loop.time(),
            )
            model.tracker.track(progress)
        trace.backend = lease.backend.name
        body = raw
        if set_to is not None:
            body = req.with_max_tokens(set_to)
        path = "/v1/chat/completions" if endpoint is Endpoint.CHAT else "/v1/completions"
        assert state.session is not None

        async def reply_headers() -> dict[str, str]:
            if admitted.late is not None:
                await _settle(request, state, model, req, admitted, progress, trace)
            return trace.headers()

        try:
            response = await forward(
                session=state.session, request=request, backend_name=lease.backend.name,
                url=lease.backend.url + path, api_key=lease.backend.api_key, body=body,
                reply_headers=reply_headers, result=result,
                on_chunk=None if progress is None else progress.feed,
            )
        except KvgateError:
            trace.outcome = Outcome.UPSTREAM_ERROR
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            trace.outcome = Outcome.CLIENT_DISCONNECT
            raise
        if result.first_byte_s is not None:
            state.metrics.first_byte(lease.backend.name, result.first_byte_s)
        if result.failed_mid_stream or result.status >= 500:
            trace.outcome = Outcome.UPSTREAM_ERROR
        return response
    finally:
        try:
            if admitted.late is not None:
                _close_late(admitted.late, trace)
            if progress is not None and model.tracker is not None:
                model.tracker.finish(
                    progress, loop.time(),
                    completed=(trace.outcome == Outcome.COMPLETED and result.status == 200
                               and not result.failed_mid_stream),
                )
        finally:
            lease.release()  # learning from the answer never stands between it and release


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _infer(request, Endpoint.CHAT)


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _infer(request, Endpoint.COMPLETIONS)


async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "kvgate",
         "max_model_len": m.config.max_model_len}
        for name, m in state.models.items()
    ]})


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    missing = [name for name, m in state.models.items()
               if not any(b.healthy for b in m.controller.backends)]
    ledger_ok = state.ledger.available
    if missing or not ledger_ok:
        return web.json_response(
            {"ready": False, "models_without_backend": missing, "ledger_available": ledger_ok},
            status=503,
        )
    return web.json_response({"ready": True, "ledger_available": True})


def _backend_view(state: ProxyState, model: ModelRuntime, backend: Backend,
                  now: float) -> dict[str, Any]:
    """One backend as this replica sees it now: the ledger's view and the engine's."""
    view: dict[str, Any] = {
        "url": backend.url, "healthy": backend.healthy,
        "capacity_tokens": backend.capacity_tokens,
        "resident_tokens": state.ledger.resident(backend.name),
        "admission_target_tokens": backend.target_tokens,
        "leases": state.ledger.lease_count(backend.name),
        "inflight": backend.inflight,
    }
    if model.tracker is not None:
        target = model.targets[backend.name]
        view.update({
            "engine_estimate_tokens": model.tracker.engine_estimate_tokens(backend.name, now),
            "lease_shortfall_tokens": model.controller.shortfall_tokens(backend),
            "engine_kv_usage_ratio": target.usage_ratio,
            "engine_preemptions_reported": target.preemptions_seen,
        })
    return view


async def _metrics(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    now = asyncio.get_running_loop().time()
    for m in state.models.values():
        state.metrics.queue_depth(m.config.name, m.controller.queue_depth)
        for b in m.controller.backends:
            view = _backend_view(state, m, b, now)
            state.metrics.backend_view(
                b.name, resident=view["resident_tokens"], inflight=b.inflight,
                target=b.target_tokens, engine_estimate=view.get("engine_estimate_tokens", 0),
                shortfall=view.get("lease_shortfall_tokens", 0),
            )
    state.metrics.ledger_available(state.ledger.available)
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def _admin_state(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    token = state.config.server.admin_token
    if token is not None:
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), token.encode()):
            raise Unauthorized(f"{request.path} needs `Authorization: Bearer <admin token>`",
                               param="Authorization")
    now = asyncio.get_running_loop().time()
    out: dict[str, Any] = {"ledger": {"kind": state.config.ledger.kind,
                                      "available": state.ledger.available}, "models": {}}
    if state.count_workers is not None:
        out["count_workers"] = state.count_workers.describe()
    for name, m in state.models.items():
        c = m.controller
        out["models"][name] = {
            "queue_depth": c.queue_depth,
            "oldest_wait_ms": round(c.oldest_wait_s(now) * 1000, 1),
            "queued_tokens": c.queued_tokens(),
            **({"output_history": {
                "samples": len(m.tracker.history), "ready": m.tracker.history.ready,
                "p50_tokens": m.tracker.history.quantile_of(0.5),
                "p90_tokens": m.tracker.history.quantile_of(0.9),
                "decode_tokens_per_s": round(m.tracker.decode_tokens_per_s, 1),
            }} if m.tracker is not None else {}),
            "capacity_source": m.config.capacity_source,
            "reservation": m.config.reservation.value,
            "backends": {b.name: _backend_view(state, m, b, now) for b in c.backends},
        }
    return web.json_response(out)


# ----------------------------------------------------------------------------- lifecycle


async def _count_workers_ctx(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE_KEY]
    n = state.config.server.count_workers
    if n > 0:
        workers = CountWorkers({m.name: str(m.path) for m in state.config.models}, n)
        await workers.start()
        state.count_workers = workers
    try:
        yield
    finally:
        if state.count_workers is not None:
            state.count_workers = None
            await workers.close()


async def _session_ctx(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE_KEY]
    server = state.config.server
    state.session = make_session(connect_timeout_s=server.upstream_connect_timeout_s,
                                 read_timeout_s=server.upstream_read_timeout_s)
    yield
    await state.session.close()


def make_ledger(config: KvgateConfig) -> Ledger:
    if config.ledger.kind == "redis":
        from proxy.redis_ledger import RedisLedger

        assert config.ledger.url is not None
        return RedisLedger(
            config.ledger.url,
            backends=[b.name for m in config.models for b in m.backends],
            key_prefix=config.ledger.key_prefix,
            lease_ttl_s=config.ledger.lease_ttl_s,
            refresh_interval_s=config.ledger.refresh_interval_s,
        )
    return MemoryLedger()


async def _ledger_ctx(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE_KEY]
    owners = {b.name: m.controller for m in state.models.values() for b in m.controller.backends}

    def wake(backend: str) -> None:
        controller = owners.get(backend)
        if controller is not None:
            controller.kick()

    state.ledger.add_listener(wake)
    await state.ledger.start()
    yield
    await state.ledger.close()


async def _probe(session: aiohttp.ClientSession, backend: Backend) -> bool:
    try:
        async with session.get(f"{backend.url}/health",
                               timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
            return resp.status < 500
    except (aiohttp.ClientError, TimeoutError):
        return False


async def _measured_capacity(session: aiohttp.ClientSession, backend: Backend) -> int | None:
    try:
        async with session.get(f"{backend.url}/metrics",
                               timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
            if resp.status != 200:
                return None
            return kv_capacity_tokens(await resp.text())
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return None


async def _health_loop(state: ProxyState) -> None:
    interval = state.config.server.health_interval_s
    while True:
        assert state.session is not None
        for model in state.models.values():
            for backend in model.controller.backends:
                healthy = await _probe(state.session, backend)
                if healthy and model.config.capacity_from_backend:
                    measured = await _measured_capacity(state.session, backend)
                    if measured is not None and measured != backend.capacity_tokens:
                        logging.getLogger("kvgate").warning(
                            "backend %s reports %d KV tokens (was %d)", backend.name,
                            measured, backend.capacity_tokens)
                        model.controller.set_capacity(backend, measured)
                        state.metrics.capacity_changed(backend.name, measured)
                    healthy = backend.capacity_tokens > 0
                if healthy != backend.healthy:
                    logging.getLogger("kvgate").warning(
                        "backend %s is %s", backend.name, "healthy" if healthy else "unhealthy")
                    backend.healthy = healthy
                    if healthy:
                        model.controller.kick()
        await asyncio.sleep(interval)


async def _resize_loop(state: ProxyState, model: ModelRuntime) -> None:
    """Follow the model's live requests: resize their leases as they generate."""
    assert model.tracker is not None
    loop = asyncio.get_running_loop()
    while True:
        try:
            await model.tracker.tick(model.controller, loop.time())
        except Exception:  # a dead loop would leave leases unfollowed: log, go on
            logging.getLogger("kvgate").exception("resizing leases of %s failed",
                                                  model.config.name)
        await asyncio.sleep(model.config.adaptive.resize_interval_s)


async def _poll_engine(state: ProxyState, model: ModelRuntime, backend: Backend,
                       now: float) -> None:
    """One scrape of one backend's engine, applied to its admission target."""
    assert state.session is not None and model.tracker is not None
    try:
        async with state.session.get(f"{backend.url}/metrics", timeout=_ENGINE_POLL_TIMEOUT) \
                as resp:
            if resp.status != 200:
                return
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return
    load = engine_load(text)
    before = apply_engine_report(
        model.tracker, backend, model.targets[backend.name], now=now,
        preemptions_total=load.preemptions_total, usage_ratio=load.usage_ratio,
        reserved_tokens=state.ledger.resident(backend.name))
    state.metrics.engine_reported(backend.name, usage_ratio=load.usage_ratio,
                                  preemptions=load.preemptions_total)
    if backend.target_factor < before:
        logging.getLogger("kvgate").warning(
            "backend %s: engine pressure (preemptions %s, KV use %s); admission "
            "target now %d of %d tokens", backend.name, load.preemptions_total,
            load.usage_ratio, backend.target_tokens, backend.capacity_tokens)
    elif backend.target_factor > before:
        model.controller.kick()


_ENGINE_POLL_TIMEOUT = aiohttp.ClientTimeout(total=2.0)


async def _engine_loop(state: ProxyState, model: ModelRuntime) -> None:
    """Close the loop with the engine's own figures (vLLM's metric names).

    A preemption, or the engine holding more than every lease, tightens the
    backend's admission target at once; quiet polls loosen it slowly.
    """
    loop = asyncio.get_running_loop()
    while True:
        for backend in model.controller.backends:
            if not backend.healthy:
                continue
            try:
                await _poll_engine(state, model, backend, loop.time())
            except Exception:  # a dead poll would freeze the admission target: log, go on
                logging.getLogger("kvgate").exception("reading the engine of %s failed",
                                                      backend.name)
        await asyncio.sleep(model.config.adaptive.engine_poll_interval_s)


async def _adaptive_ctx(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE_KEY]
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(factory(state, m))
             for m in state.models.values() if m.tracker is not None
             for factory in (_resize_loop, _engine_loop)]
    yield
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _health_ctx(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.get_running_loop().create_task(_health_loop(app[STATE_KEY]))
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _cache_stats(state: ProxyState, model: ModelRuntime) -> CacheStats | None:
    """The model's count cache: this process's, plus the count workers' where they run."""
    own = model.counter.cache_stats()
    theirs = (state.count_workers.cache_stats(model.config.name)
              if state.count_workers is not None else None)
    if own is None or theirs is None:
        return own or theirs
    return own + theirs


def build_app(config: KvgateConfig, *, ledger: Ledger | None = None) -> web.Application:
    app = web.Application(middlewares=[error_middleware])
    app[STATE_KEY] = state = ProxyState(config, ledger or make_ledger(config), Metrics())
    for name, runtime in state.models.items():
        state.metrics.watch_count_cache(name, functools.partial(_cache_stats, state, runtime))
    app.cleanup_ctx.append(_count_workers_ctx)
    app.cleanup_ctx.append(_ledger_ctx)
    app.cleanup_ctx.append(_session_ctx)
    app.cleanup_ctx.append(_health_ctx)
    app.cleanup_ctx.append(_adaptive_ctx)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/admin/state", _admin_state)
    return app


async def start_proxy(
    config: KvgateConfig, *, host: str | None = None, port: int | None = None,
    ledger: Ledger | None = None,
) -> web.AppRunner:
    """Start the proxy (port 0 picks a free one). handler_cancellation: a client that
    leaves cancels its handler, so a queued waiter leaves at once and a stream stops."""
    runner = web.AppRunner(build_app(config, ledger=ledger), handler_cancellation=True,
                           access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host or config.server.host,
                       config.server.port if port is None else port)
    await site.start()
    return runner
