"""The HTTP layer: read and validate the body, turn headers into an `Ask`, hand it to the
model's gate, forward what it admits, and map errors to the contract.

A request's life is `Gate.handle` (`proxy.gate`); this module only speaks HTTP around
it. The other routes are `proxy.admin`'s, the background loops `proxy.upstream`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web
from yarl import URL

from proxy.admin import AdminViews, bearer_token
from proxy.ask import Admitted, Ask, Record, next_request_id
from proxy.body_budget import BodyHold
from proxy.clients import Identity
from proxy.config import KvgateConfig, ServerConfig
from proxy.errors import (
    InternalError,
    InvalidRequest,
    KvgateError,
    MethodNotAllowed,
    NotFound,
    RequestTimeout,
    RequestTooLarge,
    Unauthorized,
)
from proxy.forward import Forwarded, forward, make_session
from proxy.ledger import Ledger
from proxy.metrics import Outcome
from proxy.protocol import ContractRunner
from proxy.runtime import Runtime
from proxy.tickets import TICKET_HEADER
from proxy.tokenize.cpu_lane import (
    LARGE_BODY_BYTES,
    Flow,
    cpu_lane,
    large_body,
    run_in_lane,
)
from proxy.upstream import EngineReader, health_loop
from proxy.validation import Endpoint, ValidRequest, validate

__all__ = ["RUNTIME_KEY", "build_app", "start_proxy"]

log = logging.getLogger("kvgate.request")

RUNTIME_KEY = web.AppKey("runtime", Runtime)
_SESSION_KEY = web.AppKey("session", aiohttp.ClientSession)
_RECORD_KEY = web.RequestKey("record", Record)
_PATHS = {Endpoint.CHAT: "/v1/chat/completions", Endpoint.COMPLETIONS: "/v1/completions"}


@functools.lru_cache(maxsize=1024)
def _upstream_url(base: str, endpoint: Endpoint) -> URL:
    """Parsed once per backend and endpoint, not on every request (aiohttp parses a
    string URL each time it is given one)."""
    return URL(base + _PATHS[endpoint])


def _error_response(exc: KvgateError, record: Record, *, of_request: bool = True
                    ) -> web.Response:
    """The one place a `KvgateError` becomes an HTTP answer; an inference request's
    carries its record's headers, any other only its id."""
    headers = exc.headers()
    if of_request:
        headers.update(record.headers())
    else:
        headers["x-kvgate-request-id"] = record.request_id
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


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every answer follows the error contract: errors of the other routes, unknown
    routes and methods, and, as the last resort, any exception nothing mapped, which
    becomes `500 internal_error` naming the request id that the log line with its
    traceback carries. A lease is never held here: the gate released it already."""
    record = Record(request_id=next_request_id())
    request[_RECORD_KEY] = record
    try:
        return await handler(request)
    except KvgateError as exc:
        return _error_response(exc, record, of_request=False)
    except web.HTTPException as exc:
        mapped = _http_error(request, exc)
        if mapped is None:
            raise
        return _error_response(mapped, record, of_request=False)
    except Exception as exc:
        if isinstance(exc, ConnectionResetError) and _client_gone(request):
            # No one to answer; the gate counted the outcome. aiohttp drops this quietly.
            return web.Response(status=499)
        log.exception("request %s %s %s failed with an unexpected error", record.request_id,
                      request.method, request.path)
        if request.writer.output_size > 0:
            raise  # the answer began: aiohttp cuts the connection; never a second answer
        error = InternalError(
            f"kvgate failed on this request with an internal error (request id "
            f"{record.request_id}); it is logged with its cause"
        )
        return _error_response(error, record, of_request=False)


async def _read_body(request: web.Request, server: ServerConfig, hold: BodyHold) -> bytes:
    """The body, within the byte limit, the read timeout and the body budget (`hold`): a
    stalled or endless upload must not hold a buffer and a connection for ever."""
    if request.content.is_eof():  # all of it is in (a small body comes with its headers):
        return await _read_limited(request, server.body_limit_bytes, hold)  # nothing to wait
    try:
        async with asyncio.timeout(server.body_read_timeout_s):
            return await _read_limited(request, server.body_limit_bytes, hold)
    except TimeoutError:
        request.content.feed_eof()  # answered now, and the connection closed after it
        raise RequestTimeout(
            f"the request body did not arrive within {server.body_read_timeout_s:g} s",
            param="body") from None


async def _read_limited(request: web.Request, limit: int, hold: BodyHold) -> bytes:
    """A declared length is held in the budget before any byte is read; the bytes that
    arrive beyond it (no length, or a compressed body growing) as they arrive."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise RequestTooLarge(
            f"request body is {declared} bytes; the limit is {limit} bytes", param="body"
        )
    hold.grow_to(declared or 0)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.content.iter_chunked(1 << 16):
            size += len(chunk)
            if size > limit:
                raise RequestTooLarge(
                    f"request body exceeds the limit of {limit} bytes", param="body"
                )
            hold.grow_to(size)
            chunks.append(chunk)
    except web.RequestPayloadError as exc:  # e.g. `Content-Encoding: gzip` on a plain body
        # The rest of the body cannot be parsed either: end it here, answer, and close
        # the connection (`_infer`), rather than let aiohttp drain a failed payload.
        request.content.feed_eof()
        raise InvalidRequest(f"the request body could not be read: {exc}", param="body") from exc
    return b"".join(chunks)


def _deadline(request: web.Request, runtime: Runtime) -> float:
    q = runtime.config.queue
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


def _identity(request: web.Request, runtime: Runtime) -> Identity:
    """Tenant and priority class from the identities the operator configured only
    (`proxy.clients`): a claimed priority can lower the client's class, never raise
    it; the tenant header counts only where the operator trusts it."""
    config = runtime.config
    q = config.queue
    identity = config.clients.identify(bearer_token(request),
                                       request.headers.get(q.priority_header, "")[:32])
    if identity is None:
        raise Unauthorized("a valid API key is required: `Authorization: Bearer <key>`",
                           param="Authorization")
    if q.trust_tenant_header:
        tenant = request.headers.get(q.tenant_header)
        if tenant:
            return Identity(tenant=tenant[:64], priority=identity.priority)
    return identity


async def _infer(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    """One inference request. Its body is held in the body budget from its first byte
    until it is admitted (`_send`) or answered: `finally` gives it back on every way."""
    runtime = request.app[RUNTIME_KEY]
    record = request[_RECORD_KEY]
    hold = runtime.bodies.hold()
    large = large_body.set(None)
    try:
        try:
            raw = await _read_body(request, runtime.config.server, hold)
            req = await _valid(request, runtime, raw, endpoint)
            gate = runtime.gate(req.model)
            hold.assign(gate.name)
            who = _identity(request, runtime)
            ask = Ask(request=req, raw=raw, deadline=_deadline(request, runtime),
                      priority=who.priority, tenant=who.tenant,
                      ticket=request.headers.get(TICKET_HEADER))
        except KvgateError as exc:
            record.end(exc.code)  # refused before any model's gate saw it
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            record.end(Outcome.CLIENT_DISCONNECT)
            raise
        send = functools.partial(_send, request, endpoint, hold)
        # a small request in flight: large bodies' CPU work keeps to its budget
        with contextlib.nullcontext() if large_body.get() is not None else cpu_lane().small():
            forwarded = await gate.handle(ask, record, send)
        return forwarded.response
    except KvgateError as exc:
        response = _error_response(exc, record)
        if request.content.exception() is not None or isinstance(exc, RequestTimeout):
            response.force_close()  # the rest of that body cannot be read: close after it
        return response
    finally:
        hold.release()
        large_body.reset(large)


async def _valid(request: web.Request, runtime: Runtime, raw: bytes, endpoint: Endpoint
                 ) -> ValidRequest:
    """A small body is checked here; a large one (4 MB costs up to seconds of CPU) in a
    thread, in the CPU lane with its tenant's turn, like all its later CPU work."""
    if len(raw) < LARGE_BODY_BYTES:
        return validate(raw, endpoint)
    large_body.set(Flow())
    try:
        tenant = _identity(request, runtime).tenant
    except Unauthorized:
        tenant = ""  # refused after the check, as any request without a key
    return await run_in_lane(tenant, validate, raw, endpoint)


async def _send(request: web.Request, endpoint: Endpoint, hold: BodyHold,
                admitted: Admitted) -> Forwarded:
    """Forward an admitted request; its body leaves the budget, which bounds what waits
    (what is admitted, the backends' capacity bounds)."""
    hold.release()
    backend = admitted.lease.backend
    return await forward(
        session=request.app[_SESSION_KEY], request=request, backend_name=backend.name,
        url=_upstream_url(backend.url, endpoint), api_key=backend.api_key, body=admitted.body,
        forward_authorization=not request.app[RUNTIME_KEY].config.clients.required,
        reply_headers=admitted.reply_headers,
        on_chunk=admitted.on_chunk,
    )


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _infer(request, Endpoint.CHAT)


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _infer(request, Endpoint.COMPLETIONS)


# ----------------------------------------------------------------------------- lifecycle


async def _runtime_ctx(app: web.Application) -> AsyncIterator[None]:
    runtime = app[RUNTIME_KEY]
    await runtime.start()
    try:
        yield
    finally:
        await runtime.close()


async def _session_ctx(app: web.Application) -> AsyncIterator[None]:
    server = app[RUNTIME_KEY].config.server
    app[_SESSION_KEY] = session = make_session(
        connect_timeout_s=server.upstream_connect_timeout_s,
        read_timeout_s=server.upstream_read_timeout_s)
    yield
    await session.close()


async def _loops_ctx(app: web.Application) -> AsyncIterator[None]:
    """Health probes, and in adaptive mode each gate's resize timer and engine feedback."""
    runtime, session = app[RUNTIME_KEY], app[_SESSION_KEY]
    loop = asyncio.get_running_loop()
    read_engine = EngineReader(session)
    tasks = [loop.create_task(health_loop(runtime, session))]
    tasks += [loop.create_task(gate.follow_engines(read_engine))
              for gate in runtime.gates.values()]
    yield
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def build_app(config: KvgateConfig, *, ledger: Ledger | None = None) -> web.Application:
    app = web.Application(middlewares=[error_middleware])
    app[RUNTIME_KEY] = runtime = Runtime(config, ledger)
    app.cleanup_ctx.append(_runtime_ctx)
    app.cleanup_ctx.append(_session_ctx)
    app.cleanup_ctx.append(_loops_ctx)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_routes(AdminViews(runtime).routes())
    return app


async def start_proxy(
    config: KvgateConfig, *, host: str | None = None, port: int | None = None,
    ledger: Ledger | None = None,
) -> web.AppRunner:
    """Start the proxy (port 0 picks a free one). handler_cancellation: a client that
    leaves cancels its handler, so a queued waiter leaves at once and a stream stops;
    `ContractRunner`: malformed HTTP is answered in the contract too (`proxy.protocol`)."""
    runner = ContractRunner(build_app(config, ledger=ledger), handler_cancellation=True,
                            access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host or config.server.host,
                       config.server.port if port is None else port)
    try:
        await site.start()
    except BaseException:
        # A port taken: shut down what setup started (the ledger's listener stops only
        # on close, so a bare exit would wait on it forever) and say why.
        await runner.cleanup()
        raise
    return runner
