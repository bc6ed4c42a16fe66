"""A place in line for a refused client: the ticket a 429 carries, honoured on its retry.

Without one, a client that waits the Retry-After it was given comes back as a
newcomer, behind everyone who arrived meanwhile, and under a lasting overload is
refused again: `kvgate simulate --retries 1` on the Azure conversation slice (2 x
16,384 tokens, 3 s deadline, clients capping at 2,048) admitted 15% of such retries at
2x speed and 8% at 4x. So every retryable 429 from admission (queue full, predicted
late, deadline passed) carries `x-kvgate-ticket`; a retry that sends it back, between
half its Retry-After and twice it (plus a grace), is ordered ahead of every waiter
of its priority class that holds none, and its predicted wait is counted from there.

A ticket is a signed string, not a table entry, so any replica can check it: the
model and tenant it was issued for, when, until when, a nonce, and an HMAC-SHA256 over
them with a secret (`[server] ticket_secret`, the same on every replica; without one,
each process draws its own, and a ticket is good only where it was issued: elsewhere
it is ignored, never an error). It is single-use per replica, so one ticket cannot keep
a client at the head of the line: a retry refused again gets a new ticket.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Callable

__all__ = ["TICKET_HEADER", "Tickets"]

TICKET_HEADER = "x-kvgate-ticket"
GRACE_S = 5.0  # past twice the Retry-After, still good this long
_MAC_HEX = 32  # 128 bits of the HMAC
_MAX_USED = 100_000  # nonces remembered; the oldest expire first


class Tickets:
    """Issues and redeems tickets for one process (`now`: wall clock, injectable)."""

    def __init__(self, secret: bytes | None = None, *,
                 now: Callable[[], float] = time.time) -> None:
        self._secret = secret if secret else os.urandom(32)
        self._now = now
        self._used: dict[str, float] = {}  # nonce -> its ticket's expiry

    def issue(self, model: str, tenant: str, retry_after_s: float) -> str:
        """A ticket for a retry of a request of `tenant` to `model` after `retry_after_s`."""
        now = self._now()
        start_ms = round((now + retry_after_s / 2) * 1000)
        end_ms = round((now + 2 * retry_after_s + GRACE_S) * 1000)
        nonce = secrets.token_hex(8)
        body = f"{start_ms}.{end_ms}.{nonce}"
        return f"{body}.{self._mac(model, tenant, body)}"

    def redeem(self, ticket: str, model: str, tenant: str) -> bool:
        """Whether `ticket` holds a place now for this model and tenant; a good one is
        used up. Anything else (malformed, forged, early, late, used, another
        replica's secret) is False: the request is served as any other."""
        body, _, mac = ticket.rpartition(".")
        parts = body.split(".")
        if len(parts) != 3 or len(mac) != _MAC_HEX or len(ticket) > 128:
            return False
        if not hmac.compare_digest(mac, self._mac(model, tenant, body)):
            return False
        try:
            start_s, end_s = int(parts[0]) / 1000, int(parts[1]) / 1000
        except ValueError:
            return False
        now = self._now()
        nonce = parts[2]
        if not start_s <= now <= end_s or nonce in self._used:
            return False
        self._remember(nonce, end_s, now)
        return True

    def _mac(self, model: str, tenant: str, body: str) -> str:
        message = f"{model}\0{tenant}\0{body}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()[:_MAC_HEX]

    def _remember(self, nonce: str, end_s: float, now: float) -> None:
        """Bounded: expired nonces go first, then the oldest (a ticket that old has
        expired anyway at any Retry-After kvgate gives, at most 60 s)."""
        if len(self._used) >= _MAX_USED:
            self._used = {n: e for n, e in self._used.items() if e >= now}
            while len(self._used) >= _MAX_USED:
                del self._used[next(iter(self._used))]
        self._used[nonce] = end_s
