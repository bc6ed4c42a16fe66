"""What Redis' answers mean to the shared ledger, and how a fault that recurs is logged.

An error reply that asking again will not change (`refused`) is settled on its own; no
answer, or a reply that says "not now" (`unreachable`), is retried and meanwhile the
ledger refuses admission. Shared by the ledger's calls (`proxy.redis_ledger`) and its
upkeep (`proxy.redis_upkeep`, `proxy.redis_refresh`), so both sides read a reply alike.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from redis.exceptions import (
    ClusterDownError,
    InvalidResponse,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["REDIS_ERRORS", "Repeats", "fault", "refused", "unreachable"]

log = logging.getLogger("kvgate.ledger")

# What a call to Redis may raise: `unreachable` tells a failure to reach it (retried),
# `refused` an error reply (not retried).
REDIS_ERRORS = (RedisError, OSError, asyncio.TimeoutError)

# Error replies that say "not now" rather than "never": a server still loading or
# demoted to a replica, a script running too long, memory full under noeviction, a
# cluster reconfiguring, too few replicas for a write. They pass, and count as Redis
# being out of reach meanwhile. (redis-py strips the code from the errors it has a
# class for.)
_PASSING_REPLIES = (ClusterDownError, OutOfMemoryError, ReadOnlyError, TryAgainError)
_PASSING_CODES = frozenset({"BUSY", "CLUSTERDOWN", "LOADING", "MASTERDOWN", "NOREPLICAS",
                            "OOM", "READONLY", "TRYAGAIN"})


def refused(exc: BaseException) -> bool:
    """Whether `exc` is an error reply that asking again will not change: a WRONGTYPE (a
    key another program wrote), a script's runtime error, NOSCRIPT where loading the
    script is refused, NOPERM, an unknown command.

    Redis answered, so it is not an outage, and is not handled as one. Retrying would
    fail the same way for good and hold up everything queued behind it (the worker
    runs in order), and marking Redis unreachable would refuse admission on every
    backend, and log an outage, for one key that is broken. So each operation it
    answers is logged as refused and settled on its own: a reserve answers 503 (kvgate
    never admits without the ledger), a resize keeps the lease's size, a release still
    counts as released on this replica (its lease, no longer renewed, is reclaimed by a
    refresh pass at its TTL once the scripts run again there), a ready mark leaves its
    blocks unshared (charged in full: the safe side), and a renewal, a refresh pass and
    a resident read are done again on the next pass.
    """
    if not isinstance(exc, ResponseError):
        return False
    return not (isinstance(exc, _PASSING_REPLIES)
                or str(exc).partition(" ")[0] in _PASSING_CODES)


def unreachable(exc: BaseException) -> bool:
    """Whether `exc` says Redis cannot serve the ledger for now: no answer (a lost
    connection, a timeout, a garbled reply) or an error reply that passes. Retried,
    and meanwhile the ledger refuses admission. What is neither (an error in the
    client's own input) is a bug, for the caller's catch-all."""
    if isinstance(exc, ResponseError):
        return not refused(exc)
    return isinstance(exc, (RedisConnectionError, RedisTimeoutError, InvalidResponse,
                            OSError, asyncio.TimeoutError))


class Repeats:
    """Logs a fault that recurs (on every refresh pass, on every release to a broken key)
    once per `every_s`, then says how often it recurred since: a lasting fault stays in
    sight without flooding the log. Faults are told apart by a key (what failed, where,
    and the error)."""

    def __init__(self, every_s: float = 30.0) -> None:
        self._every_s = every_s
        self._seen: dict[tuple[str, ...], list[float]] = {}  # key -> [logged at, since]

    def log(self, key: tuple[str, ...], level: int, message: str, *args: Any,
            exc_info: BaseException | None = None) -> None:
        now = time.monotonic()
        seen = self._seen.get(key)
        if seen is not None and now - seen[0] < self._every_s:
            seen[1] += 1
            return
        if seen is not None and seen[1]:
            message += " (and %d more like it since it was last logged)"
            args += (int(seen[1]),)
        if len(self._seen) >= 1024:  # keys carry error texts: keep them bounded
            self._seen.clear()
        self._seen[key] = [now, 0]
        log.log(level, message, *args, exc_info=exc_info)


def fault(exc: BaseException) -> tuple[str, str]:
    return type(exc).__name__, str(exc)
