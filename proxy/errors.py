"""The error contract, in one place.

    KvgateError
    ├── InvalidRequest            400 invalid_request
    ├── ContextLengthExceeded     400 context_length_exceeded
    ├── MaxTokensRequired         400 max_tokens_required
    ├── Unauthorized              401 unauthorized
    ├── ModelNotFound             404 model_not_found
    ├── NotFound                  404 not_found
    ├── MethodNotAllowed          405 method_not_allowed
    ├── RequestTooLarge           413 request_too_large
    ├── QueueFull                 429 queue_full
    ├── QueueTimeout              429 queue_timeout
    ├── NoBackend                 503 no_backend
    ├── LedgerUnavailable         503 ledger_unavailable
    ├── MemoryBudgetFull          503 memory_budget
    ├── UpstreamError             502 upstream_error
    └── InternalError             500 internal_error

Bodies are OpenAI-shaped (`{"error": {"message", "type", "code", "param"}}`) so the
official SDKs raise their matching exception with our code and message. Errors a
retry can cure carry `Retry-After` and `retry-after-ms` (both SDKs honour them);
the others carry `x-should-retry: false` (a 500 too: it is a defect kvgate answers the
same way again, not an overload). After the first streamed byte the same
body travels as an SSE `error` event (`sse_event`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import ClassVar

from proxy.tickets import TICKET_HEADER

__all__ = [
    "ERROR_TABLE",
    "ContextLengthExceeded",
    "InternalError",
    "InvalidRequest",
    "KvgateError",
    "LedgerUnavailable",
    "MaxTokensRequired",
    "MemoryBudgetFull",
    "MethodNotAllowed",
    "ModelNotFound",
    "NoBackend",
    "NotFound",
    "QueueFull",
    "QueueTimeout",
    "RequestTimeout",
    "RequestTooLarge",
    "Unauthorized",
    "UpstreamError",
]


class KvgateError(Exception):
    """Base of every error kvgate answers with; subclasses fix status and code."""

    status: ClassVar[int] = 500
    code: ClassVar[str] = "internal_error"
    type: ClassVar[str] = "server_error"
    retryable: ClassVar[bool] = False

    def __init__(
        self, message: str, *, param: str | None = None, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self.ticket: str | None = None  # a 429's place in line (`proxy.tickets`)

    @property
    def reason(self) -> str:
        """The rejection's label in metrics and the log line: its code, unless a code
        covers two causes a client need not tell apart (see `QueueTimeout`)."""
        return self.code

    def __repr__(self) -> str:
        return f"{type(self).__name__}(status={self.status}, code={self.code!r}, {self.message!r})"

    def to_body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "code": self.code,
                "param": self.param,
            }
        }

    def headers(self) -> dict[str, str]:
        if not self.retryable:
            return {"x-should-retry": "false"}
        wait_s = max(0.001, self.retry_after_s if self.retry_after_s is not None else 1.0)
        headers = {
            "Retry-After": str(max(1, math.ceil(wait_s))),
            "retry-after-ms": str(max(1, math.ceil(wait_s * 1000))),
        }
        if self.ticket is not None:
            headers[TICKET_HEADER] = self.ticket
        return headers

    def sse_event(self) -> bytes:
        """The same body as an SSE `error` event, for failures after streaming began."""
        return b"event: error\ndata: " + json.dumps(self.to_body()).encode() + b"\n\n"


class InvalidRequest(KvgateError):
    """Malformed JSON, wrong types or missing fields; the message names the field."""

    status = 400
    code = "invalid_request"
    type = "invalid_request_error"


class ContextLengthExceeded(KvgateError):
    """Prompt plus max_tokens is over the model's context length."""

    status = 400
    code = "context_length_exceeded"
    type = "invalid_request_error"

    def __init__(self, *, max_model_len: int, prompt_tokens: int, max_tokens: int,
                 counted_to: bool = False) -> None:
        """`counted_to`: counting stopped once the prompt passed the context, so
        `prompt_tokens` is a lower bound, not the prompt's count."""
        self.max_model_len = max_model_len
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        if counted_to:
            message = (
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"the messages alone hold at least {prompt_tokens} tokens (kvgate stopped "
                "counting there). Please reduce the length of the messages.")
        else:
            message = (
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
                f"messages, {max_tokens} in the completion). Please reduce the length of the "
                "messages or completion.")
        super().__init__(message, param="messages")


class MaxTokensRequired(KvgateError):
    """Output policy `require` and the request names no max_tokens."""

    status = 400
    code = "max_tokens_required"
    type = "invalid_request_error"


class Unauthorized(KvgateError):
    """An admin route without the configured `server.admin_token`."""

    status = 401
    code = "unauthorized"
    type = "authentication_error"


class ModelNotFound(KvgateError):
    """The model is not served here; the message lists the served models."""

    status = 404
    code = "model_not_found"
    type = "invalid_request_error"


class NotFound(KvgateError):
    """No route at this path (the OpenAI-compatible routes are under /v1)."""

    status = 404
    code = "not_found"
    type = "invalid_request_error"


class MethodNotAllowed(KvgateError):
    """The path exists, the method does not; `Allow` lists the ones that do."""

    status = 405
    code = "method_not_allowed"
    type = "invalid_request_error"

    def __init__(self, message: str, *, allowed: Iterable[str]) -> None:
        super().__init__(message)
        self.allowed = tuple(sorted(allowed))

    def headers(self) -> dict[str, str]:
        return {**super().headers(), "Allow": ", ".join(self.allowed)}


class RequestTooLarge(KvgateError):
    """Body over the byte limit, or a demand no backend could ever hold."""

    status = 413
    code = "request_too_large"
    type = "invalid_request_error"


class QueueFull(KvgateError):
    """The bounded queue is at its depth limit."""

    status = 429
    code = "queue_full"
    type = "rate_limit_error"
    retryable = True


class QueueTimeout(KvgateError):
    """The request's deadline passed while it waited for capacity, or it was predicted
    not to start before it and refused at once (`predicted`; reason
    `queue_timeout_predicted` in metrics and logs, the same code for the client)."""

    status = 429
    code = "queue_timeout"
    type = "rate_limit_error"
    retryable = True

    def __init__(self, message: str, *, retry_after_s: float | None = None,
                 predicted: bool = False) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.predicted = predicted

    @property
    def reason(self) -> str:
        return "queue_timeout_predicted" if self.predicted else self.code


class NoBackend(KvgateError):
    """No healthy backend serves the model."""

    status = 503
    code = "no_backend"
    type = "server_error"
    retryable = True


class LedgerUnavailable(KvgateError):
    """The shared ledger cannot be reached: kvgate never admits blindly."""

    status = 503
    code = "ledger_unavailable"
    type = "server_error"
    retryable = True


class MemoryBudgetFull(KvgateError):
    """The bytes of request bodies waiting for admission, in total or of this model,
    would pass `server.body_budget` (or `body_budget_per_model`) with this one's: many
    large bodies must not pin the proxy's memory. Nothing else was held for it."""

    status = 503
    code = "memory_budget"
    type = "server_error"
    retryable = True


class UpstreamError(KvgateError):
    """The backend failed before the first byte of its answer."""

    status = 502
    code = "upstream_error"
    type = "server_error"
    retryable = True


class RequestTimeout(KvgateError):
    """The client did not send its whole body within `server.body_read_timeout_s`: a
    stalled upload would otherwise hold its buffer (and a connection) for ever."""

    status = 408
    code = "request_timeout"
    type = "invalid_request_error"


class InternalError(KvgateError):
    """A defect: an exception nothing else mapped. The message gives the request id that
    the log line with the traceback carries; any reservation was released."""

    status = 500
    code = "internal_error"
    type = "server_error"


ERROR_TABLE: dict[str, type[KvgateError]] = {
    cls.code: cls
    for cls in (
        InvalidRequest,
        ContextLengthExceeded,
        MaxTokensRequired,
        Unauthorized,
        ModelNotFound,
        NotFound,
        MethodNotAllowed,
        RequestTooLarge,
        RequestTimeout,
        QueueFull,
        QueueTimeout,
        NoBackend,
        LedgerUnavailable,
        MemoryBudgetFull,
        UpstreamError,
        InternalError,
    )
}
