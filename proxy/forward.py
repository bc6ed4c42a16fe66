"""Forward a request to its backend and stream the answer back unchanged.

One shared `ClientSession` per app (auto_decompress off, so bytes pass through
as the backend sent them). Foreign client errors become `UpstreamError` in one
place, `map_upstream_errors`. Before the first byte a failure is a 502; after
it, an event-stream ends with an SSE `error` event, never a fake `[DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import ClientRequest, web
from aiohttp.connector import Connection
from aiohttp.tracing import Trace
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from proxy.errors import UpstreamError

__all__ = ["ClientDisconnected", "Forwarded", "forward", "make_session",
           "map_upstream_errors"]

_log = logging.getLogger("kvgate")

_BODY_HEADERS = frozenset({"content-type", "content-encoding"})
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "host", "content-length",
})


def make_session(*, connect_timeout_s: float, read_timeout_s: float) -> aiohttp.ClientSession:
    """No total timeout: a long generation is not an error. Idle reads and connects are.

    Its connector tells `_post` which requests went out on a pooled connection."""
    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
    )
    connector = _ReuseAwareConnector(limit=0, ttl_dns_cache=300)
    return aiohttp.ClientSession(timeout=timeout, connector=connector, auto_decompress=False)


class _Attempt:
    """One send of a POST: did it get a pooled connection?"""

    __slots__ = ("reused",)

    def __init__(self) -> None:
        self.reused = False


# The send in progress in this task, for the connector to mark (`_post` sets it around
# `session.post`, which asks the connector for a connection in the same task).
_attempt: ContextVar[_Attempt | None] = ContextVar("kvgate_forward_attempt", default=None)


class _ReuseAwareConnector(aiohttp.TCPConnector):
    """A connector that marks the current `_Attempt` when it hands out a connection it
    handed out before (a pooled one), by the identity of its protocol: aiohttp makes a
    new protocol object for every connection it opens.

    Rather than aiohttp's `on_connection_reuseconn` trace signal: any trace config makes
    every request of the session build and send all ~6 trace events (request start,
    chunk sent, headers, end...), a cost on every request for a fact needed only when
    a send fails."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._handed_out: weakref.WeakSet[asyncio.BaseProtocol] = weakref.WeakSet()

    async def connect(self, req: ClientRequest, traces: list[Trace],
                      timeout: aiohttp.ClientTimeout) -> Connection:  # noqa: ASYNC109
        connection = await super().connect(req, traces, timeout)
        protocol = connection.protocol
        attempt = _attempt.get()
        if protocol is not None:
            if attempt is not None:
                attempt.reused = protocol in self._handed_out
            self._handed_out.add(protocol)
        return connection


# Several pooled connections can be dead at once (answers that ended together), and a
# send on each fails the same way; past this many resends the last failure stands.
_STALE_RETRIES = 4


def _stale(exc: aiohttp.ClientConnectionError) -> bool:
    """The failure of a send on a pooled connection the backend had already closed, its
    FIN not yet read (llama-server closes after every streamed answer; any server ends
    idle keep-alive connections): the write fails (`ClientOSError`, or a
    `ConnectionResetError` that is also a client error: "Cannot write to closing
    transport") or the connection ends before the status line (`ServerDisconnectedError`).
    A connect error (`ClientConnectorError`, a `ClientOSError`) cannot follow a reuse; a
    timeout is never taken for one."""
    return (isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError
                       | ConnectionResetError)
            and not isinstance(exc, aiohttp.ClientConnectorError))


async def _post(
    session: aiohttp.ClientSession, url: str | URL, body: bytes, headers: CIMultiDict[str],
    backend: str,
) -> aiohttp.ClientResponse:
    """POST; sent again only where it failed on a reused connection before its answer.

    Such a request is taken as never read: the connection was dead before it left. (A
    backend that read it and hung up without a byte looks the same from here; it gets
    the request again, once per pooled connection it drops so.) Each resend takes a
    connection as the pool gives it, and stops at the first that answers or fails
    otherwise. A failure on a fresh connection, a timeout, or any failure once the
    status line and headers are in, may follow a request the engine read: that POST is
    never sent twice. (A session without `make_session`'s connector reports no reuse,
    so nothing is resent through it.)
    """
    retries = 0
    while True:
        attempt = _Attempt()
        token = _attempt.set(attempt)
        try:
            return await session.post(url, data=body, headers=headers)
        except aiohttp.ClientConnectionError as exc:
            if not (attempt.reused and _stale(exc)) or retries == _STALE_RETRIES:
                raise
            _log.debug("backend %s: stale pooled connection (%r), sending again", backend, exc)
        finally:
            _attempt.reset(token)
        retries += 1


@contextlib.contextmanager
def map_upstream_errors(backend: str) -> Iterator[None]:
    try:
        yield
    except TimeoutError as exc:
        raise UpstreamError(f"backend {backend!r} timed out") from exc
    except aiohttp.ClientError as exc:
        raise UpstreamError(f"backend {backend!r} failed: {exc}") from exc


class ClientDisconnected(ConnectionResetError):
    """Writing to the client failed: it left. aiohttp raises `ClientConnectionResetError`
    for this, which is also an `aiohttp.ClientError`, the family upstream failures belong
    to; re-raised as this plain `ConnectionResetError` it cannot be taken for one."""


async def _to_client(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except ConnectionResetError as exc:
        raise ClientDisconnected(f"the client left: {exc}") from exc


def _request_headers(
    incoming: CIMultiDictProxy[str], api_key: str | None, *, forward_authorization: bool = True,
    peer: str | None = None,
) -> CIMultiDict[str]:
    """What the backend is sent: the client's end-to-end headers, less hop-by-hop ones
    (also those its `Connection` header names), kvgate's own and the client's
    credentials where kvgate checked them or holds the backend's key."""
    listed = {t.strip().lower() for v in incoming.getall("Connection", []) for t in v.split(",")}
    headers: CIMultiDict[str] = CIMultiDict()
    for key, value in incoming.items():
        lower = key.lower()
        if lower in HOP_BY_HOP or lower in listed or lower.startswith("x-kvgate-"):
            continue
        if lower in _BODY_HEADERS or (lower == "authorization"
                                      and (api_key or not forward_authorization)):
            continue
        headers.add(key, value)
    # The body sent is the JSON kvgate parsed, as received after aiohttp decoded any
    # Content-Encoding: label it so, whatever type or encoding the client declared.
    headers["Content-Type"] = "application/json"
    if "Accept-Encoding" not in headers:
        # aiohttp would ask for gzip on its own; answers pass through undecoded, so a
        # client that asked for no encoding must get none.
        headers["Accept-Encoding"] = "identity"
    if peer:
        forwarded_for = headers.popall("X-Forwarded-For", [])
        headers["X-Forwarded-For"] = ", ".join([*forwarded_for, peer])
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


class _EventFraming:
    """Relay an event stream in whole events: a chunk that ends inside an event keeps
    that event's start back until its end arrives (the bytes are the backend's, only
    their split changes), so a failure mid-stream adds kvgate's `error` event after a
    complete one, never inside a half-sent one that a client's SSE parser would choke
    on. An event past `_MAX_PENDING` is let through as it comes."""

    __slots__ = ("pending",)
    _MAX_PENDING = 1 << 16

    def __init__(self) -> None:
        self.pending = b""

    def complete(self, chunk: bytes) -> bytes:
        """The whole events `chunk` completes; keeps the rest pending."""
        if not self.pending and chunk.endswith(b"\n\n"):
            return chunk  # the usual case: events arrive whole
        data = self.pending + chunk if self.pending else chunk
        lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
        end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        if end == 0 and len(data) <= self._MAX_PENDING:
            self.pending = data
            return b""
        if end == 0:
            end = len(data)
        self.pending = data[end:]
        return data[:end] if end < len(data) else data


@dataclass(frozen=True, slots=True)
class Forwarded:
    """The answer sent, and how the forward ended (for the gate's outcome and metrics)."""

    response: web.StreamResponse
    status: int
    first_byte_s: float | None
    failed_mid_stream: bool = False


async def forward(
    *,
    session: aiohttp.ClientSession,
    request: web.Request,
    backend_name: str,
    url: str | URL,
    api_key: str | None,
    body: bytes,
    reply_headers: Callable[[], Awaitable[Mapping[str, str]]],
    on_chunk: Callable[[bytes], None] | None = None,
    forward_authorization: bool = True,
) -> Forwarded:
    """Send `body` to `url` and stream the answer; raises UpstreamError before the first byte.

    `reply_headers` is awaited once the backend's answer has begun, just before the
    reply's headers leave: a request admitted on a bound of its prompt finishes its
    exact count meanwhile, and the headers report that count.
    """
    started = time.perf_counter()
    headers = _request_headers(request.headers, api_key,
                               forward_authorization=forward_authorization,
                               peer=request.remote)
    with map_upstream_errors(backend_name):
        upstream = await _post(session, url, body, headers, backend_name)
    first_byte_s: float | None = None
    try:
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for key, value in upstream.headers.items():
            if key.lower() not in HOP_BY_HOP:
                response.headers.add(key, value)
        response.headers.update(await reply_headers())
        length = upstream.content_length
        if length is not None and upstream.headers.get("Transfer-Encoding") is None:
            # The body passes byte for byte (no decompression), so the backend's length
            # holds: relayed as is, a short answer leaves in one write with its headers,
            # not as chunks plus a terminating chunk, and a cut body stays detectable.
            response.content_length = length
        is_sse = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
        await response.prepare(request)
        events = _EventFraming() if is_sse else None
        try:
            async for chunk in upstream.content.iter_any():
                if first_byte_s is None:
                    first_byte_s = time.perf_counter() - started
                if events is not None and not (chunk := events.complete(chunk)):
                    continue
                if on_chunk is not None:
                    on_chunk(chunk)
                await _to_client(response, chunk)
            if events is not None and events.pending:
                await _to_client(response, events.pending)  # the backend's own last bytes
        except (aiohttp.ClientError, TimeoutError) as exc:
            if is_sse:  # the half event it broke off in is dropped: clients parse each event
                error = UpstreamError(f"backend {backend_name!r} failed mid-stream: {exc}")
                await _to_client(response, error.sse_event())
                await response.write_eof()
            elif request.transport is not None:
                request.transport.close()  # a cut body, never a clean-looking end
            return Forwarded(response, upstream.status, first_byte_s, failed_mid_stream=True)
        if first_byte_s is None:
            first_byte_s = time.perf_counter() - started
        await response.write_eof()
        return Forwarded(response, upstream.status, first_byte_s)
    finally:
        upstream.close()
