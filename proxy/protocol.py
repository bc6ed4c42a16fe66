"""aiohttp's connection handler, made to answer malformed HTTP in the error contract.

A request whose request line or headers do not parse never reaches the app, so no
middleware sees it: aiohttp's `RequestHandler.handle_error` answers it with a plain-text
400 and logs the parser's exception with its traceback at ERROR, about 560 bytes per
request, so any client could fill the log. aiohttp has no setting for either
(aio-libs/aiohttp#3287), so `ContractRunner` serves the app with connection handlers
of the class `ContractRequestHandler`: a parse error is answered `400 invalid_request`
as JSON, like every other bad request, and logged as one short line.
"""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from proxy.ask import next_request_id
from proxy.errors import InvalidRequest

__all__ = ["ContractRequestHandler", "ContractRunner", "malformed_http_response"]

log = logging.getLogger("kvgate.request")

# The parser's reason quotes the client's bytes over several lines: the answer and the
# log line carry it on one line, cut short.
_REASON_CHARS = 160


def malformed_http_response(exc: HttpProcessingError, remote: str | None) -> web.Response:
    """The contract's answer to a request aiohttp could not parse, and its log line.
    The connection is closed after it: the parser cannot find the next request."""
    request_id = next_request_id()
    reason = " ".join(exc.message.split())[:_REASON_CHARS] or type(exc).__name__
    log.info("request %s from %s: malformed HTTP (%s: %r), answered 400 invalid_request",
             request_id, remote, type(exc).__name__, reason)
    error = InvalidRequest(f"the request is not valid HTTP/1.1: {reason}")
    headers = {**error.headers(), "x-kvgate-request-id": request_id}
    response = web.json_response(error.to_body(), status=error.status, headers=headers)
    response.force_close()
    return response


class ContractRequestHandler(web.RequestHandler):
    """aiohttp's handler of one connection, but for the answer to what does not parse."""

    __slots__ = ()

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None, message: str | None = None
                     ) -> web.StreamResponse:
        """A parse error of the request line or headers gets the contract's 400; any
        other error (none reaches here past `error_middleware`) is aiohttp's."""
        if isinstance(exc, HttpProcessingError) and request.writer.output_size == 0:
            return malformed_http_response(exc, request.remote)
        return super().handle_error(request, status, exc, message)


class _ContractServer(web.Server):
    """The app's `web.Server`; only the handler it makes per connection differs."""

    def __call__(self) -> web.RequestHandler:
        return ContractRequestHandler(self, loop=self._loop, **self._kwargs)


class ContractRunner(web.AppRunner):
    """`web.AppRunner` whose connections are handled by `ContractRequestHandler`."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()  # the app started, its server built
        # aiohttp builds the `web.Server` itself and offers no factory for the handler
        # class; the subclass adds no state, only `__call__`, so the server is kept.
        server.__class__ = _ContractServer
        return server
