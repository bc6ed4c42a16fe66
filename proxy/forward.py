"""Forward a request to its backend and stream the answer back unchanged.

One shared `ClientSession` per app (auto_decompress off, so bytes pass through
as the backend sent them). Foreign client errors become `UpstreamError` in one
place, `map_upstream_errors`. Before the first byte a failure is a 502; after
it, an event-stream ends with an SSE `error` event, never a fake `[DONE]`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from proxy.errors import UpstreamError

__all__ = ["ClientDisconnected", "Forwarded", "forward", "make_session",
           "map_upstream_errors"]

_BODY_HEADERS = frozenset({"content-type", "content-encoding"})
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "host", "content-length",
})


def make_session(*, connect_timeout_s: float, read_timeout_s: float) -> aiohttp.ClientSession:
    """No total timeout: a long generation is not an error. Idle reads and connects are."""
    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
    )
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    return aiohttp.ClientSession(timeout=timeout, connector=connector, auto_decompress=False)


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
    incoming: Mapping[str, str], api_key: str | None
) -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict()
    for key, value in incoming.items():
        lower = key.lower()
        if lower in HOP_BY_HOP or lower.startswith("x-kvgate-"):
            continue
        if lower in _BODY_HEADERS or (lower == "authorization" and api_key):
            continue
        headers.add(key, value)
    # The body sent is the JSON kvgate parsed, as received after aiohttp decoded any
    # Content-Encoding: label it so, whatever type or encoding the client declared.
    headers["Content-Type"] = "application/json"
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


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
    url: str,
    api_key: str | None,
    body: bytes,
    reply_headers: Callable[[], Awaitable[Mapping[str, str]]],
    on_chunk: Callable[[bytes], None] | None = None,
) -> Forwarded:
    """Send `body` to `url` and stream the answer; raises UpstreamError before the first byte.

    `reply_headers` is awaited once the backend's answer has begun, just before the
    reply's headers leave: a request admitted on a bound of its prompt finishes its
    exact count meanwhile, and the headers report that count.
    """
    started = time.perf_counter()
    headers = _request_headers(request.headers, api_key)
    with map_upstream_errors(backend_name):
        upstream = await session.post(url, data=body, headers=headers)
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
        try:
            async for chunk in upstream.content.iter_any():
                if first_byte_s is None:
                    first_byte_s = time.perf_counter() - started
                if on_chunk is not None:
                    on_chunk(chunk)
                await _to_client(response, chunk)
        except (aiohttp.ClientError, TimeoutError) as exc:
            if is_sse:
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
