"""The shared ledger's upkeep: what keeps this replica's leases registered in Redis.

`proxy.redis_ledger` answers the `Ledger` calls (reserve, resize, release); what keeps
those answers right between calls lives here, the way redis-py keeps a connection's
upkeep apart from its commands:

* the worker: releases, ready marks and renewals, in order, pipelined in batches,
  retried while Redis cannot be reached (so `release()` never awaits); an error reply
  is not retried (`refused`);
* the refresh pass and the listener (`proxy.redis_refresh`, which extends `Upkeep`);
* loss and rebuild: whether Redis can be reached, the epoch each backend's leases are
  registered under, and how long a rebuild still refuses admission (the scripts that
  detect and repair a loss: `proxy.redis_scripts`).

The ledger owns its state and hands `Upkeep` what both sides touch: its live leases,
its view of each backend's resident tokens, the epochs the reserve and resize scripts
check, and the queue its releases go on. It starts the three tasks and stops them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, ResponseError

from proxy.errors import LedgerUnavailable
from proxy.redis_faults import REDIS_ERRORS, Repeats, fault, refused, unreachable
from proxy.redis_policy import UnsafeRedisConfig, eviction_risk
from proxy.redis_scripts import LOST, READY_LUA, REBUILDING, RECLAIM_LUA, RELEASE_LUA, RENEW_LUA

__all__ = ["KEY_CHARS", "LiveLease", "Op", "ResidentView", "Upkeep", "as_text"]

log = logging.getLogger("kvgate.ledger")

KEY_CHARS = 16  # a block key: 64 bits in hex (`proxy.prefix_blocks`)

# What the worker runs, in order: (kind, backend, lease_id), kind "release", "ready" or
# "renew" (a renewal names no lease: it re-registers all of the backend's).
Op = tuple[str, str, str]


@dataclass(slots=True)
class LiveLease:
    """A live lease as this replica registered it: enough to re-register it."""

    backend: str
    tokens: int  # all it spans
    refs: str = ""  # its `#<lease_id>` field: block size, '|', the keys it references
    ref_tokens: int = 0  # block size x keys it references
    block_tokens: int = 0
    shared: int = 0  # tokens ready blocks of others covered at reserve
    ready: bool = False
    ref_keys: tuple[str, ...] = ()  # the keys it references, in order (a chain's run)

    @property
    def own(self) -> int:
        return max(0, self.tokens - self.ref_tokens)


class ResidentView:
    """This replica's view of each backend's resident tokens in Redis.

    `release()` counts a lease released here at once and only queues its script, so a
    reply Redis read before that script ran (a refresh pass, a notice's read, a reserve
    or renewal already in flight) still holds the lease: written as it is, it would undo
    the release (and for a release Redis refused, keep it until the next pass that
    Redis answers). Each value read from Redis is taken less what this replica released
    since the command was sent: `mark()` before sending, `read()` with the reply. A
    release whose script overtakes a command sent before it is then taken off twice:
    the view is low by it until the next value read (Redis decides admission on its own
    counters; this view feeds placement and the metrics).
    """

    __slots__ = ("_freed", "_tokens")

    def __init__(self, backends: list[str]) -> None:
        self._tokens: dict[str, int] = dict.fromkeys(backends, 0)
        self._freed: dict[str, int] = dict.fromkeys(backends, 0)  # released here, ever

    def get(self, backend: str) -> int:
        return self._tokens.get(backend, 0)

    def released(self, backend: str, tokens: int) -> None:
        self._freed[backend] = self._freed.get(backend, 0) + tokens
        self._tokens[backend] = max(0, self._tokens.get(backend, 0) - tokens)

    def mark(self, backend: str) -> int:
        return self._freed.get(backend, 0)

    def read(self, backend: str, value: int, mark: int) -> None:
        since = self._freed.get(backend, 0) - mark
        self._tokens[backend] = max(0, value - since)


def as_text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Upkeep:
    """The ledger's background tasks, and the loss and rebuild state they share with it."""

    def __init__(
        self,
        *,
        backends: list[str],
        keys: Callable[[str], list[str]],
        channel: str,
        ttl_ms: int,
        refresh_s: float,
        window_s: float,
        live: dict[str, LiveLease],
        resident: ResidentView,
        epoch: dict[str, str],
        ops: asyncio.Queue[Op],
        closing: Callable[[], bool],
    ) -> None:
        self._backends = backends
        self._keys = keys
        self._channel = channel
        self._ttl_ms = ttl_ms
        self._refresh_s = refresh_s
        self._window_s = window_s
        self._live = live
        self._resident = resident
        # the epoch each backend's leases were last registered under (the ledger's
        # scripts send it); the backends whose leases are registered under the current
        # epoch as far as this replica knows (a backend leaves on a loss and on losing
        # contact with Redis, and comes back with its next renewal); until when
        # (time.monotonic()) each backend is being rebuilt
        self._epoch = epoch
        self._registered: set[str] = set()
        self._rebuilding_until: dict[str, float] = {}
        self._ops = ops
        self._renew_pending: set[str] = set()
        # redis-py's get_message can absorb a cancel, so the listener stops on a flag
        self._closing = closing
        self._listeners: list[Callable[[str], None]] = []
        self._repeats = Repeats()
        self._was_available = False
        self._client: aioredis.Redis | None = None
        self.reachable = False
        self._policy_said: str | None = None
        self._policy_checked_at = 0.0
        self.reclaimed_total = 0
        self.readded_total = 0
        self.rebuilds_total = 0  # epochs this replica started (a loss, or a first start)
        self.drift_fixed_total = 0  # tokens the resident counters were off by, repaired

    # ------------------------------------------------------------------ first contact
    def attach(self, client: aioredis.Redis) -> None:
        """The ledger's client: the upkeep's scripts run on the same pool."""
        self._client = client
        self._release = client.register_script(RELEASE_LUA)
        self._renew = client.register_script(RENEW_LUA)
        self._reclaim = client.register_script(RECLAIM_LUA)
        self._ready = client.register_script(READY_LUA)

    async def connect(self) -> bool:
        """Ping, refuse an evicting Redis (closes the client and raises
        `UnsafeRedisConfig`) and register every backend's leases under the current
        epoch (starting one on an empty ledger). -> whether Redis answered."""
        assert self._client is not None
        with contextlib.suppress(*REDIS_ERRORS):
            await self._client.ping()
            self.reachable = True
        if not self.reachable:
            return False
        try:
            problem = await self.check_eviction_policy()
            self._policy_checked_at = time.monotonic()
        except REDIS_ERRORS:
            problem = None  # read on the first refresh pass that reaches Redis
        if problem is not None:
            await self._client.aclose()
            raise UnsafeRedisConfig(problem)
        with contextlib.suppress(*REDIS_ERRORS):
            await self._run_batch([("renew", b, "") for b in self._backends])
        return True

    async def check_eviction_policy(self) -> str | None:
        """-> why Redis may evict the ledger's keys, or None (`proxy.redis_policy`)."""
        assert self._client is not None
        return await eviction_risk(self._client, self._say_policy)

    def _say_policy(self, state: str, level: int, message: str, *args: Any) -> None:
        if state != self._policy_said:
            self._policy_said = state
            log.log(level, message, *args)

    # ------------------------------------------------------------------ reachable, available
    @property
    def available(self) -> bool:
        return (self.reachable and len(self._registered) == len(self._backends)
                and self.rebuilding_left_s() <= 0)

    def rebuilding_left_s(self) -> float:
        if not self._rebuilding_until:
            return 0.0
        return max(self._rebuilding_until.values()) - time.monotonic()

    def add_listener(self, callback: Callable[[str], None]) -> None:
        self._listeners.append(callback)

    def set_reachable(self, reachable: bool, error: BaseException | None = None) -> None:
        """What each answer from Redis (or its absence) says, the ledger's calls' too."""
        if reachable == self.reachable:
            return
        self.reachable = reachable
        if not reachable:
            # Redis may lose its data while out of reach: this replica is not ready again
            # before its renewal has re-registered its leases (and learnt the epoch).
            self._registered.clear()
            log.warning("shared ledger is UNREACHABLE: %s: %s", type(error).__name__, error)
            return
        log.warning("shared ledger is reachable")
        self._notify_all()

    def say_refused(self, what: str, backend: str, lease_id: str, exc: BaseException,
                    then: str) -> None:
        """Log an error reply as one (`refused`): what Redis refused, for which lease on
        which backend, its reply, and what follows; the same again once per 30 s."""
        whose = f" of lease {lease_id}" if lease_id else ""
        self._repeats.log((what, backend, *fault(exc)), logging.ERROR,
                          "shared ledger of %s: Redis refused the %s%s: %s: %s; %s",
                          backend, what, whose, type(exc).__name__, exc, then)

    def _notify_all(self) -> None:
        for backend in self._backends:
            self._notify(backend)

    def _notify(self, backend: str) -> None:
        """Tell each listener; one that raises is logged and the others are still told:
        a listener's bug must not stop the loop that calls it (the worker, the refresh
        pass, the pub/sub listener) nor a reserve that has just been recorded."""
        for callback in self._listeners:
            try:
                callback(backend)
            except Exception as exc:
                self._repeats.log(
                    ("listener", repr(callback), *fault(exc)), logging.ERROR,
                    "shared ledger: a listener (%r) raised on a notice for %s; the ledger "
                    "goes on", callback, backend, exc_info=exc)

    # ------------------------------------------------------------------ loss and rebuild
    def refusal(self, backend: str, status: int, left_ms: int) -> LedgerUnavailable:
        """An epoch refusal from a script: note it, and -> the 503 to answer with."""
        if status == REBUILDING:
            left_s = left_ms / 1000
            self._rebuilding_until[backend] = time.monotonic() + left_s
            return LedgerUnavailable(
                f"the shared ledger of {backend!r} is being rebuilt after Redis lost its "
                f"data; kvgate admits again in {left_s:.1f} s, once every replica has "
                "re-registered its live leases",
                retry_after_s=left_s,
            )
        self._lost(backend, gone=status == LOST)
        return LedgerUnavailable(
            f"the shared ledger of {backend!r} lost its data in Redis (a restart without "
            "persistence, an eviction, a flush); kvgate re-registers the live leases and "
            f"admits again in about {self._window_s:.1f} s",
            retry_after_s=max(self._window_s, self._refresh_s),
        )

    def _lost(self, backend: str, *, gone: bool) -> None:
        """The epoch is gone (`gone`) or not the one this replica registered under:
        not available until this replica's leases are registered again (the renewal's
        answer then says how long the rebuild still runs)."""
        if backend in self._registered:
            count = sum(1 for live in self._live.values() if live.backend == backend)
            if gone:
                log.warning("shared ledger of %s LOST its data in Redis (a restart without "
                            "persistence, an eviction, a flush): re-registering this "
                            "replica's %d live leases; no admission until the rebuild is "
                            "done", backend, count)
            else:
                log.warning("shared ledger of %s was rebuilt by another replica: "
                            "re-registering this replica's %d live leases", backend, count)
        self._registered.discard(backend)
        self._queue_renewal(backend)

    def _queue_renewal(self, backend: str) -> None:
        if backend not in self._renew_pending:
            self._renew_pending.add(backend)
            self._ops.put_nowait(("renew", backend, ""))

    # ------------------------------------------------------------------ the worker
    async def worker(self) -> None:
        """Releases and renewals, in order, pipelined in batches, retried until Redis answers.

        One pipeline per batch keeps releases from falling behind a busy replica:
        a burst of N releases costs one round trip, not N. The retry delay stays within
        one refresh interval, so a replica re-registers its leases promptly once Redis
        is back.

        Only a cancel stops the worker: one that stopped would leave every later release
        unsent (held in Redis until its TTL) and `drain()` waiting forever. Anything else
        a batch raises besides Redis' errors (a bug: a reply misread) is logged with its
        traceback and the batch dropped, not retried, since the same bug would fail it
        again: a dropped release's lease is reclaimed by Redis at its TTL (this replica
        no longer renews it), a dropped renewal is queued again by the next refresh
        pass, a dropped ready mark leaves its blocks unshared (charged in full). Each
        failure in a row pauses the worker twice as long, up to the retry delay's cap,
        so a failure that repeats does not spin.
        """
        max_delay = min(1.0, max(0.05, self._refresh_s))
        failed = 0  # batches in a row that raised
        while True:
            batch = [await self._ops.get()]
            while len(batch) < 512 and not self._ops.empty():
                batch.append(self._ops.get_nowait())
            try:
                await self._apply(batch, max_delay)
                failed = 0
            except Exception as exc:
                failed += 1
                kinds = Counter(kind for kind, _, _ in batch)
                self._repeats.log(
                    ("worker", *fault(exc)), logging.ERROR,
                    "shared ledger: a batch of %s failed and is dropped, not retried "
                    "(released leases are reclaimed at their TTL, renewals are queued "
                    "again by the refresh pass); the worker goes on",
                    ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())),
                    exc_info=exc)
                for kind, backend, _ in batch:
                    if kind == "renew":
                        self._renew_pending.discard(backend)
                await asyncio.sleep(min(max_delay, 0.05 * 2 ** min(failed, 8)))
            finally:
                for _ in batch:
                    self._ops.task_done()

    async def _apply(self, batch: list[Op], max_delay: float) -> None:
        """Run `batch`: what Redis cannot run now (no answer, or an error reply that
        passes) is sent again, backing off, until it can; an error reply that does not
        pass settles its op alone (`refused`), so it holds up nothing queued behind it."""
        delay = 0.05
        reloaded = False
        while batch:
            error: BaseException | None
            try:
                batch, error, noscript = await self._run_batch(batch, reloaded)
            except REDIS_ERRORS as exc:
                if not unreachable(exc):
                    raise  # not Redis failing: the worker's catch-all logs it
                error = exc
            else:
                reloaded = reloaded or noscript
                if error is None:
                    # Redis answered; a NOSCRIPT is sent once more at once
                    self.set_reachable(True)
                    continue
            self.set_reachable(False, error)
            await asyncio.sleep(delay)
            delay = min(max_delay, delay * 2)

    async def _run_batch(self, batch: list[Op], reloaded: bool = False,
                         ) -> tuple[list[Op], ResponseError | None, bool]:
        """One pipeline for `batch`, and each answer taken in. -> the ops to send again,
        the error reply that passes which some of them got (None: none did), and
        whether some got NOSCRIPT: the script cache emptied between the pipeline's
        check and its run (a SCRIPT FLUSH, a failover); the next pipeline loads the
        scripts first, so a NOSCRIPT is sent once more, unless the scripts were
        `reloaded` already. An error reply that does not pass is logged and its op not
        sent again (`refused`). Raises when Redis cannot be reached."""
        assert self._client is not None
        pipe = self._client.pipeline(transaction=False)
        for kind, backend, lease_id in batch:
            if kind == "release":
                await self._release(keys=self._keys(backend),
                                    args=[lease_id, self._channel, backend], client=pipe)
            elif kind == "ready":
                await self._ready(keys=self._keys(backend), args=[lease_id], client=pipe)
            else:
                await self._renew(keys=self._keys(backend), args=self._renew_args(backend),
                                  client=pipe)
        marks = {backend: self._resident.mark(backend) for _, backend, _ in batch}
        results = await self._execute(pipe, len(batch))
        again: list[Op] = []
        passing: ResponseError | None = None
        noscript = False
        for op, result in zip(batch, results, strict=True):
            kind, backend, lease_id = op
            if isinstance(result, ResponseError):
                if isinstance(result, NoScriptError) and not reloaded:
                    again.append(op)
                    noscript = True
                elif not refused(result):
                    again.append(op)
                    passing = result
                else:
                    self._refused(op, result)
                continue
            if kind == "release":
                self._resident.read(backend, int(result[1]), marks[backend])
                continue
            if kind == "ready":
                continue
            self._renew_pending.discard(backend)
            self._renewed(backend, result, marks[backend])
        return again, passing, noscript

    @staticmethod
    async def _execute(pipe: Any, n: int) -> list[Any]:
        """Each op's answer, an error reply among them as its exception. Where loading
        the pipeline's scripts is refused (before any op ran), that is every op's."""
        try:
            results: list[Any] = await pipe.execute(raise_on_error=False)
        except ResponseError as exc:
            if not refused(exc):
                raise
            return [exc] * n
        finally:
            # redis-py resets a pipeline only once its scripts are loaded: one whose
            # SCRIPT LOAD failed would keep its pooled connection for good
            await pipe.reset()
        return results

    def _refused(self, op: Op, exc: ResponseError) -> None:
        kind, backend, lease_id = op
        if kind == "release":
            self.say_refused("release", backend, lease_id, exc,
                             "not retried: this replica counts the lease released; Redis "
                             "keeps it until its TTL, when a refresh pass reclaims it")
        elif kind == "ready":
            self.say_refused("ready mark", backend, lease_id, exc,
                             "not retried: its blocks stay unshared (later leases pay for "
                             "them in full)")
        else:
            self._renew_pending.discard(backend)
            self.say_refused("renewal of this replica's leases", backend, "", exc,
                             "not retried now: the next refresh pass renews them again")

    def _renew_args(self, backend: str) -> list[Any]:
        args: list[Any] = [self._ttl_ms, self._channel, backend, secrets.token_hex(8),
                           int(self._window_s * 1000)]
        for lease_id, live in list(self._live.items()):
            if live.backend == backend:
                args += [lease_id, live.own, live.refs, 1 if live.ready else 0]
        return args

    def _renewed(self, backend: str, result: list[Any], mark: int) -> None:
        resident, reclaimed, readded = int(result[0]), int(result[1]), int(result[2])
        epoch, left_ms, created = as_text(result[3]), int(result[4]), int(result[5])
        drift, indexed = int(result[6]), int(result[7])
        self._resident.read(backend, resident, mark)
        self.reclaimed_total += reclaimed
        self.readded_total += readded
        self._epoch[backend] = epoch
        self._registered.add(backend)
        self._rebuilding_until[backend] = time.monotonic() + max(0, left_ms) / 1000
        if created:
            self.rebuilds_total += 1
            log.warning("shared ledger of %s had no epoch in Redis (its first start, or "
                        "Redis lost its data): started epoch %s from this replica's %d live "
                        "leases (%d tokens); no admission for %.1f s while the other "
                        "replicas re-register theirs", backend, epoch, readded, resident,
                        left_ms / 1000)
        elif readded:
            log.warning("re-added %d live leases on %s after Redis lost them", readded, backend)
        self._drifted(backend, 0 if created else drift, indexed)

    def _drifted(self, backend: str, drift: int, indexed: int) -> None:
        if drift:
            self.drift_fixed_total += abs(drift)
            log.warning("resident counter of %s was %+d tokens off the sum of its leases: "
                        "repaired", backend, -drift)
        if indexed:
            log.warning("%d leases on %s had lost their expiry: given one lease TTL",
                        indexed, backend)
