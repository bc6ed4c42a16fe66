"""What goes into a gate and what a request leaves: the ask, its record, its admission.

Plain data, shared by the HTTP layer, the gate and the replay; no I/O.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from proxy.admission import Demand, Lease
from proxy.reservation import Progress
from proxy.validation import ValidRequest

__all__ = ["Admitted", "Ask", "Record", "S", "Sent", "next_request_id"]

log = logging.getLogger("kvgate.request")

_REQUEST_ID_PREFIX = secrets.token_hex(4)  # per process: ids stay unique across replicas
_request_seq = itertools.count()


def next_request_id() -> str:
    """16 hex digits: a random per-process prefix and a counter (no syscall per request)."""
    return f"{_REQUEST_ID_PREFIX}{next(_request_seq) & 0xFFFFFFFF:08x}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Ask:
    """A request as the gate takes it: the validated body and what the transport said."""

    request: ValidRequest
    raw: bytes  # the body as received: count workers parse it again, unchanged bodies go as is
    deadline: float  # loop time by which it must be admitted
    priority: str = ""
    tenant: str = ""
    prompt_tokens: tuple[int, ...] | None = None  # counted already (a replay): no counting
    blocks: tuple[str, ...] = ()  # with prompt_tokens: its shared-prefix block keys
    ticket: str | None = None  # a 429's ticket sent back (`proxy.tickets`)


@dataclass(slots=True)
class Record:
    """One request's facts for its headers, its metrics and its log line."""

    request_id: str
    model: str = "-"
    backend: str = "-"
    prompt_tokens: int | None = None
    reserved_tokens: int | None = None
    shared_tokens: int | None = None  # of reserved_tokens, covered by shared prefix blocks
    queue_wait_ms: float = 0.0
    output_cap: int | None = None
    held_place: bool = False  # it brought a good ticket: ordered ahead (`proxy.tickets`)
    outcome: str | None = None
    started: float = field(default_factory=time.perf_counter)

    def headers(self) -> dict[str, str]:
        out = {"x-kvgate-queue-wait-ms": f"{self.queue_wait_ms:.1f}",
               "x-kvgate-request-id": self.request_id}
        if self.prompt_tokens is not None:
            out["x-kvgate-prompt-tokens"] = str(self.prompt_tokens)
        if self.reserved_tokens is not None:
            out["x-kvgate-reserved-tokens"] = str(self.reserved_tokens)
        if self.shared_tokens is not None:
            out["x-kvgate-shared-prefix-tokens"] = str(self.shared_tokens)
        if self.output_cap is not None:
            out["x-kvgate-output-cap"] = str(self.output_cap)
        return out

    def end(self, outcome: str) -> None:
        """Close the record with its outcome and write its log line; once."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        if log.isEnabledFor(logging.INFO):
            log.info(json.dumps({
                "id": self.request_id, "model": self.model, "backend": self.backend,
                "prompt_tokens": self.prompt_tokens, "reserved_tokens": self.reserved_tokens,
                "queue_wait_ms": round(self.queue_wait_ms, 1), "outcome": str(outcome),
                "duration_ms": round((time.perf_counter() - self.started) * 1000, 1),
            }))


class Sent(Protocol):
    """How the transport's send ended, as far as the gate needs to know."""

    @property
    def status(self) -> int: ...

    @property
    def first_byte_s(self) -> float | None: ...

    @property
    def failed_mid_stream(self) -> bool: ...


S = TypeVar("S", bound=Sent)


@dataclass(slots=True, eq=False)
class Admitted:
    """A request holding its lease, handed to the transport to send."""

    lease: Lease
    demand: Demand
    body: bytes  # what to forward: the client's body, or with the output cap written in
    output_cap: int | None  # max_tokens the output policy set, if it set one
    record: Record
    progress: Progress | None = None
    # Admitted on an upper bound of the prompt: its exact count, running meanwhile.
    late_count: asyncio.Task[tuple[int, float, tuple[str, ...]]] | None = None
    # ...and its lease shrinking to it, from the moment the count is in: a bound held
    # until the reply's headers (an engine round trip) kept requests that fit waiting.
    settling: asyncio.Task[None] | None = None

    def on_chunk(self, chunk: bytes) -> None:
        """Each piece of the answer as it passes: the first says the prefill is done."""
        self.lease.answered()
        if self.progress is not None:
            self.progress.feed(chunk)

    async def reply_headers(self) -> dict[str, str]:
        """Awaited by the transport just before the reply's headers leave: a request
        admitted on a bound settles on its exact count first, so they report it."""
        if self.settling is not None:
            await self.settling
        return self.record.headers()
