"""The shared ledger: several proxy replicas, one ceiling per backend, in Redis.

Keys and scripts: `proxy.redis_scripts`.

Leases carry a TTL; the owning replica renews its live leases every ttl/3. A
crashed or partitioned replica stops renewing, and every replica's refresh pass
(each `refresh_interval_s`) reclaims expired leases, as does any reserve. Worst-case
time to reclaim after a crash: lease_ttl_s + refresh_interval_s (30.5 s with the
defaults), plus one round trip.

A reserve whose reply never came (cancelled, timed out, connection cut) queues its
own undo: the script may have run, and the release script ignores unknown leases.

Losing the data, drift and eviction: `proxy.redis_scripts`, where the scripts that
detect and repair them live.

`release()` never awaits: it drops the lease locally and queues the script on one
worker task, which runs releases and renewals in order and retries them until
Redis answers. While Redis cannot be reached, `reserve()` raises
`LedgerUnavailable`: kvgate never admits blindly.

Release notifications go over pub/sub (`<prefix>:released`, payload = backend), so
a waiter on replica B wakes when replica A releases; a periodic refresh covers a
lost message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from proxy.errors import LedgerUnavailable
from proxy.redis_policy import UnsafeRedisConfig, eviction_risk
from proxy.redis_scripts import (
    LOST,
    READY_LUA,
    REBUILDING,
    RECLAIM_LUA,
    RELEASE_LUA,
    RENEW_LUA,
    RESERVE_LUA,
    RESIZE_LUA,
)

__all__ = ["RedisLedger", "UnsafeRedisConfig"]

log = logging.getLogger("kvgate.ledger")

_CONNECTION_ERRORS = (RedisError, OSError, asyncio.TimeoutError)
_KEY_CHARS = 16  # a block key: 64 bits in hex (`proxy.prefix_blocks`)


@dataclass(slots=True)
class _Live:
    """A live lease as this replica registered it: enough to re-register it."""

    backend: str
    tokens: int  # all it spans
    refs: str = ""  # its `#<lease_id>` field: block size, '|', the keys it references
    ref_tokens: int = 0  # block size x keys it references
    block_tokens: int = 0
    shared: int = 0  # tokens ready blocks of others covered at reserve
    ready: bool = False

    @property
    def own(self) -> int:
        return max(0, self.tokens - self.ref_tokens)

    def ref_keys(self) -> list[str]:
        keys = self.refs.partition("|")[2]
        return [keys[i:i + _KEY_CHARS] for i in range(0, len(keys), _KEY_CHARS)]

def default_recovery_window_s(lease_ttl_s: float, refresh_interval_s: float) -> float:
    """How long a rebuilt ledger refuses admission while the other replicas re-register
    their leases: three refresh passes (each replica re-registers on the first pass
    that sees the loss), at least 1 s, but no longer than a renewal period plus a pass,
    by when every live replica has re-registered by renewing anyway."""
    return min(lease_ttl_s / 3 + refresh_interval_s, max(1.0, 3 * refresh_interval_s))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisLedger:
    """`Ledger` over Redis; see the module docstring for the protocol."""

    def __init__(
        self,
        url: str,
        *,
        backends: Iterable[str],
        key_prefix: str = "kvgate",
        lease_ttl_s: float = 30.0,
        refresh_interval_s: float = 0.5,
        socket_timeout_s: float = 2.0,
        recovery_window_s: float | None = None,
    ) -> None:
        if lease_ttl_s <= 0:
            raise ValueError(f"`lease_ttl_s` must be > 0. Given: {lease_ttl_s}")
        if recovery_window_s is None:
            recovery_window_s = default_recovery_window_s(lease_ttl_s, refresh_interval_s)
        if recovery_window_s < 0:
            raise ValueError(f"`recovery_window_s` must be >= 0. Given: {recovery_window_s}")
        self._url = url
        self._backends = list(backends)
        self._prefix = key_prefix
        self._ttl_ms = int(lease_ttl_s * 1000)
        self._refresh_s = refresh_interval_s
        self._socket_timeout_s = socket_timeout_s
        self._window_s = recovery_window_s
        self._channel = f"{key_prefix}:released"
        self._resident: dict[str, int] = dict.fromkeys(self._backends, 0)
        self._live: dict[str, _Live] = {}
        # per backend, the blocks this replica's live leases reference: key -> [leases,
        # ready]; what placement reads (the reserve script decides on Redis' own)
        self._local_refs: dict[str, dict[str, list[int]]] = {b: {} for b in self._backends}
        self._block_tokens: dict[str, int] = {}
        self._ops: asyncio.Queue[tuple[str, str, str]] = asyncio.Queue()
        self._renew_pending: set[str] = set()
        self._listeners: list[Callable[[str], None]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._client: aioredis.Redis | None = None
        self._reachable = False
        self._closing = False
        # the epoch each backend's leases were last registered under; the backends whose
        # leases are registered under the current epoch as far as this replica knows (a
        # backend leaves on a loss and on losing contact with Redis, and comes back with
        # its next renewal); until when (time.monotonic()) each backend is being rebuilt
        self._epoch: dict[str, str] = {}
        self._registered: set[str] = set()
        self._rebuilding_until: dict[str, float] = {}
        self._policy_said: str | None = None
        self._policy_checked_at = 0.0
        self.reclaimed_total = 0
        self.readded_total = 0
        self.rebuilds_total = 0  # epochs this replica started (a loss, or a first start)
        self.drift_fixed_total = 0  # tokens the resident counters were off by, repaired

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Connect, refuse an evicting Redis (`UnsafeRedisConfig`), register under the
        current epoch (starting one on an empty ledger) and, where the ledger is being
        rebuilt, wait out the window: on return the ledger admits, or Redis cannot be
        reached (then reserves answer `LedgerUnavailable` until it can)."""
        # A blocking pool: a burst of admissions waits for a connection instead of
        # failing, and a bounded pool keeps Redis' connection count predictable.
        #
        # One immediate retry on a connection error: a pooled connection that Redis
        # closed (restart, failover, idle timeout) fails its first command before
        # the client notices, and that is not an outage. A fresh connection either
        # answers or fails at once (connection refused), so a real outage still
        # gives a prompt 503. Every script here is safe to run twice: RELEASE and
        # RENEW are idempotent, RESERVE recognises its own lease id.
        pool = aioredis.BlockingConnectionPool.from_url(
            self._url,
            max_connections=64,
            retry=Retry(NoBackoff(), 1),
            retry_on_error=[RedisConnectionError],
            timeout=self._socket_timeout_s,
            socket_timeout=self._socket_timeout_s,
            socket_connect_timeout=self._socket_timeout_s,
        )
        self._client = aioredis.Redis(connection_pool=pool)
        self._reserve = self._client.register_script(RESERVE_LUA)
        self._release = self._client.register_script(RELEASE_LUA)
        self._renew = self._client.register_script(RENEW_LUA)
        self._resize = self._client.register_script(RESIZE_LUA)
        self._reclaim = self._client.register_script(RECLAIM_LUA)
        self._ready = self._client.register_script(READY_LUA)
        with contextlib.suppress(*_CONNECTION_ERRORS):
            await self._client.ping()
            self._reachable = True
        if self._reachable:
            try:
                problem = await self.check_eviction_policy()
                self._policy_checked_at = time.monotonic()
            except _CONNECTION_ERRORS:
                problem = None  # read on the first refresh pass that reaches Redis
            if problem is not None:
                await self._client.aclose()
                raise UnsafeRedisConfig(problem)
            with contextlib.suppress(*_CONNECTION_ERRORS):
                await self._run_batch([("renew", b, "") for b in self._backends])
        else:
            log.warning("shared ledger is UNREACHABLE at start: %s", self._url_for_log())
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._worker()),
            loop.create_task(self._maintain()),
            loop.create_task(self._listen()),
        ]
        wait_s = self._rebuilding_left_s()
        if wait_s > 0:
            log.warning("shared ledger is being rebuilt: admitting in %.1f s", wait_s)
        # A renewal meanwhile may move the window's end, and a timer may fire a hair
        # before it: wait until it has passed (a few passes at most).
        for _ in range(8):
            if (wait_s := self._rebuilding_left_s()) <= 0:
                break
            await asyncio.sleep(wait_s + 0.001)

    async def drain(self) -> None:
        """Wait until every release and renewal queued so far has reached Redis.

        `release()` only queues; a caller that counts releases as done (a benchmark,
        a shutdown that must not leave leases to the TTL) waits here.
        """
        await self._ops.join()

    async def close(self) -> None:
        # Give queued releases a moment; whatever is left expires by TTL.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                await self._ops.join()
        # redis-py's get_message can absorb a cancel, so the listener stops on a flag.
        self._closing = True
        for task in self._tasks[:2]:
            task.cancel()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(3.0):
                await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

    async def check_eviction_policy(self) -> str | None:
        """-> why Redis may evict the ledger's keys, or None (`proxy.redis_policy`)."""
        assert self._client is not None
        return await eviction_risk(self._client, self._say_policy)

    def _say_policy(self, state: str, level: int, message: str, *args: Any) -> None:
        if state != self._policy_said:
            self._policy_said = state
            log.log(level, message, *args)

    def _url_for_log(self) -> str:
        # no password in logs: redis://user:secret@host -> redis://host
        scheme, sep, rest = self._url.partition("://")
        return f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else self._url

    # ------------------------------------------------------------------ protocol
    @property
    def available(self) -> bool:
        """False while Redis cannot be reached, until this replica has registered its
        leases again after losing contact or data, and while the ledger is being rebuilt."""
        return (self._reachable and len(self._registered) == len(self._backends)
                and self._rebuilding_left_s() <= 0)

    @property
    def recovery_window_s(self) -> float:
        return self._window_s

    def add_listener(self, callback: Callable[[str], None]) -> None:
        """Called with a backend name whenever capacity there may have come back."""
        self._listeners.append(callback)

    def keys(self, backend: str) -> list[str]:
        tag = f"{self._prefix}:{{{backend}}}"
        return [f"{tag}:resident", f"{tag}:leases", f"{tag}:expiry", f"{tag}:refs",
                f"{tag}:ready"]

    async def reserve(self, backend: str, lease_id: str, tokens: int, capacity: int,
                      blocks: Sequence[str] = (), block_tokens: int = 0) -> bool:
        if lease_id[:1] in ("=", "#"):
            raise ValueError(f"lease ids may not start with '=' or '#': {lease_id!r}")
        if any(len(key) != _KEY_CHARS for key in blocks):
            raise ValueError(f"block keys are {_KEY_CHARS} hex digits")
        if blocks and block_tokens * len(blocks) > tokens:
            raise ValueError(f"{len(blocks)} blocks of {block_tokens} tokens exceed the "
                             f"lease's {tokens} tokens")
        try:
            result = await self._reserve(
                keys=self.keys(backend),
                args=[lease_id, tokens, capacity, self._ttl_ms, self._channel, backend,
                      self._epoch.get(backend, ""), block_tokens if blocks else 0,
                      "".join(blocks)],
            )
        except asyncio.CancelledError:
            # The script may have run: undo it (the release script ignores unknown leases).
            self._ops.put_nowait(("release", backend, lease_id))
            raise
        except _CONNECTION_ERRORS as exc:
            # The script may have run and only its reply was lost (a timeout, a
            # connection cut after the retry): undo it like a cancelled reserve, or
            # the capacity would be held by nobody until the TTL.
            self._ops.put_nowait(("release", backend, lease_id))
            self._set_reachable(False, exc)
            raise LedgerUnavailable(
                f"the shared ledger cannot be reached ({type(exc).__name__}); "
                "kvgate does not admit without it",
                retry_after_s=self._refresh_s * 4,
            ) from exc
        self._set_reachable(True)
        status = int(result[0])
        if status <= LOST:
            raise self._refusal(backend, status, int(result[1]))
        resident = int(result[1])
        self._resident[backend] = resident
        if status == -1:
            # Lease ids are never reused (a random per-process prefix and a counter),
            # so the same id with the same tokens is this very reservation, retried
            # after its first reply was lost.
            recorded = int(result[2])
            if recorded != tokens:
                raise ValueError(
                    f"lease {lease_id!r} is already recorded with {recorded} tokens, "
                    f"not {tokens}"
                )
            status, result = 1, [1, resident, 0, result[3]]  # what it was charged: lost
        if status == 1 and lease_id not in self._live:
            self._record(lease_id, backend, tokens, blocks, block_tokens, result)
        return status == 1

    def _record(self, lease_id: str, backend: str, tokens: int, blocks: Sequence[str],
                block_tokens: int, result: list[Any]) -> None:
        """What the script registered: the keys it referenced are all those brought,
        or the list it sent back (a key registered but not ready is paid in full)."""
        live = _Live(backend, tokens, shared=int(result[2]))
        if int(result[3]):
            which = _text(result[4]) if len(result) > 4 else ""
            refs = ([which[i:i + _KEY_CHARS] for i in range(0, len(which), _KEY_CHARS)]
                    if which else list(dict.fromkeys(blocks)))
            table = self._local_refs.setdefault(backend, {})
            for key in refs:
                table.setdefault(key, [0, 0])[0] += 1
            live.refs = f"{block_tokens}|{''.join(refs)}"
            live.ref_tokens = block_tokens * len(refs)
            live.block_tokens = block_tokens
            self._block_tokens[backend] = block_tokens
        self._live[lease_id] = live

    async def resize(self, lease_id: str, tokens: int, capacity: int) -> int:
        live = self._live.get(lease_id)
        if live is None:
            return 0
        if not self.available:
            # Redis is known to be down or rebuilding: the lease keeps its size at once,
            # rather than each resize (the tick, dispatch) waiting out a socket timeout in
            # turn. Reserves and the refresh pass find out when it is back.
            return live.tokens
        tokens = max(tokens, live.ref_tokens)  # the shared blocks stay
        backend = live.backend
        try:
            result = await self._resize(
                keys=self.keys(backend),
                args=[lease_id, tokens - live.ref_tokens, capacity, self._channel, backend,
                      self._epoch.get(backend, "")],
            )
        except _CONNECTION_ERRORS as exc:
            # The lease keeps its recorded size; the request itself goes on.
            self._set_reachable(False, exc)
            return live.tokens
        self._set_reachable(True)
        granted = int(result[0])
        if granted <= LOST:
            # Rebuilding: nothing changed; the lease keeps the size it is registered with.
            self._refusal(backend, granted, int(result[1]))
            return live.tokens if lease_id in self._live else 0
        self._resident[backend] = int(result[1])
        if lease_id not in self._live:
            return 0  # released here while the script ran; the release script follows
        if granted < 0:
            # Redis lost a live lease (restart, outage past the TTL): the next renewal
            # re-adds it at the size recorded here.
            return live.tokens
        live.tokens = granted + live.ref_tokens
        return live.tokens

    def release(self, lease_id: str) -> None:
        live = self._live.pop(lease_id, None)
        if live is None:
            return
        freed = live.own
        table = self._local_refs.get(live.backend, {})
        block = live.block_tokens
        for key in live.ref_keys():
            entry = table.get(key)
            if entry is not None:
                entry[0] -= 1
                if entry[0] <= 0:
                    del table[key]
                    freed += block  # as far as this replica knows; Redis' reply corrects it
        backend = live.backend
        self._resident[backend] = max(0, self._resident.get(backend, 0) - freed)
        self._ops.put_nowait(("release", backend, lease_id))

    def mark_ready(self, lease_id: str) -> None:
        live = self._live.get(lease_id)
        if live is None or live.ready or not live.refs:
            return
        live.ready = True
        table = self._local_refs.get(live.backend, {})
        for key in live.ref_keys():
            entry = table.get(key)
            if entry is not None:
                entry[1] = 1
        self._ops.put_nowait(("ready", live.backend, lease_id))

    def shared_tokens(self, lease_id: str) -> int:
        live = self._live.get(lease_id)
        return 0 if live is None else live.shared

    def ready_blocks(self, backend: str, blocks: Sequence[str]) -> int:
        """From this replica's own live leases: what placement needs is a good guess of
        where a prefix lives; the reserve script charges from Redis' exact refs."""
        table = self._local_refs.get(backend)
        if not table:
            return 0
        n = 0
        for key in blocks:
            entry = table.get(key)
            if entry is None or not entry[1]:
                break
            n += 1
        return n

    def shared_resident(self, backend: str) -> int:
        """This replica's view: blocks its own live leases reference."""
        return len(self._local_refs.get(backend, ())) * self._block_tokens.get(backend, 0)

    def resident(self, backend: str) -> int:
        return self._resident.get(backend, 0)

    def lease_count(self, backend: str) -> int:
        return sum(1 for live in self._live.values() if live.backend == backend)

    async def resident_now(self, backend: str) -> int:
        """Read Redis directly (tests, admin)."""
        assert self._client is not None
        value = await self._client.get(self.keys(backend)[0])
        return int(value or 0)

    # ------------------------------------------------------------------ loss and rebuild
    def _rebuilding_left_s(self) -> float:
        if not self._rebuilding_until:
            return 0.0
        return max(self._rebuilding_until.values()) - time.monotonic()

    def _refusal(self, backend: str, status: int, left_ms: int) -> LedgerUnavailable:
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
            if gone:
                log.warning("shared ledger of %s LOST its data in Redis (a restart without "
                            "persistence, an eviction, a flush): re-registering this "
                            "replica's %d live leases; no admission until the rebuild is "
                            "done", backend, self.lease_count(backend))
            else:
                log.warning("shared ledger of %s was rebuilt by another replica: "
                            "re-registering this replica's %d live leases",
                            backend, self.lease_count(backend))
        self._registered.discard(backend)
        self._queue_renewal(backend)

    def _queue_renewal(self, backend: str) -> None:
        if backend not in self._renew_pending:
            self._renew_pending.add(backend)
            self._ops.put_nowait(("renew", backend, ""))

    # ------------------------------------------------------------------ background
    def _set_reachable(self, reachable: bool, error: BaseException | None = None) -> None:
        if reachable == self._reachable:
            return
        self._reachable = reachable
        if not reachable:
            # Redis may lose its data while out of reach: this replica is not ready again
            # before its renewal has re-registered its leases (and learnt the epoch).
            self._registered.clear()
            log.warning("shared ledger is UNREACHABLE: %s: %s", type(error).__name__, error)
            return
        log.warning("shared ledger is reachable")
        self._notify_all()

    def _notify_all(self) -> None:
        for backend in self._backends:
            for callback in self._listeners:
                callback(backend)

    async def _worker(self) -> None:
        """Releases and renewals, in order, pipelined in batches, retried until Redis answers.

        One pipeline per batch keeps releases from falling behind a busy replica:
        a burst of N releases costs one round trip, not N. The retry delay stays within
        one refresh interval, so a replica re-registers its leases promptly once Redis
        is back.
        """
        max_delay = min(1.0, max(0.05, self._refresh_s))
        while True:
            batch = [await self._ops.get()]
            while len(batch) < 512 and not self._ops.empty():
                batch.append(self._ops.get_nowait())
            try:
                delay = 0.05
                while True:
                    try:
                        await self._run_batch(batch)
                        self._set_reachable(True)
                        break
                    except _CONNECTION_ERRORS as exc:
                        self._set_reachable(False, exc)
                        await asyncio.sleep(delay)
                        delay = min(max_delay, delay * 2)
            finally:
                for _ in batch:
                    self._ops.task_done()

    async def _run_batch(self, batch: list[tuple[str, str, str]]) -> None:
        assert self._client is not None
        pipe = self._client.pipeline(transaction=False)
        for kind, backend, lease_id in batch:
            if kind == "release":
                await self._release(keys=self.keys(backend),
                                    args=[lease_id, self._channel, backend], client=pipe)
            elif kind == "ready":
                await self._ready(keys=self.keys(backend), args=[lease_id], client=pipe)
            else:
                await self._renew(keys=self.keys(backend), args=self._renew_args(backend),
                                  client=pipe)
        results = await pipe.execute()
        for (kind, backend, _), result in zip(batch, results, strict=True):
            if kind == "release":
                self._resident[backend] = int(result[1])
                continue
            if kind == "ready":
                continue
            self._renew_pending.discard(backend)
            self._renewed(backend, result)

    def _renewed(self, backend: str, result: list[Any]) -> None:
        resident, reclaimed, readded = int(result[0]), int(result[1]), int(result[2])
        epoch, left_ms, created = _text(result[3]), int(result[4]), int(result[5])
        drift, indexed = int(result[6]), int(result[7])
        self._resident[backend] = resident
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

    def _renew_args(self, backend: str) -> list[Any]:
        args: list[Any] = [self._ttl_ms, self._channel, backend, secrets.token_hex(8),
                           int(self._window_s * 1000)]
        for lease_id, live in list(self._live.items()):
            if live.backend == backend:
                args += [lease_id, live.own, live.refs, 1 if live.ready else 0]
        return args

    async def _maintain(self) -> None:
        """Renew leases every ttl/3 (every pass while unreachable or rebuilding), else
        reclaim expired ones, check the epoch and repair drift; refresh the resident view."""
        renew_every_s = self._ttl_ms / 3000
        since_renew = renew_every_s
        was_available = self.available
        while True:
            if since_renew >= renew_every_s or not self.available:
                for backend in self._backends:
                    self._queue_renewal(backend)
                since_renew = 0.0
            else:
                try:
                    await self._reclaim_expired()
                except _CONNECTION_ERRORS as exc:
                    self._set_reachable(False, exc)
            if self._reachable and (not self._policy_checked_at or time.monotonic()
                                    - self._policy_checked_at >= renew_every_s):
                with contextlib.suppress(*_CONNECTION_ERRORS):
                    problem = await self.check_eviction_policy()
                    self._policy_checked_at = time.monotonic()
                    if problem is not None:
                        # Too late to refuse to start: say it loudly; a lost lease hash
                        # is still caught by the epoch and rebuilt.
                        self._say_policy("unsafe", logging.ERROR, "%s", problem)
            available = self.available
            if available and not was_available and self._reachable:
                log.warning("shared ledger admits again")
            was_available = available
            # Waiters re-check after each pass: this covers a lost pub/sub message.
            self._notify_all()
            await asyncio.sleep(self._refresh_s)
            since_renew += self._refresh_s

    async def _reclaim_expired(self) -> None:
        """One pipelined pass: reclaim expired leases, check each backend's epoch, repair
        drift, refresh the resident view."""
        assert self._client is not None
        pipe = self._client.pipeline(transaction=False)
        for backend in self._backends:
            await self._reclaim(keys=self.keys(backend),
                                args=[self._channel, backend, self._ttl_ms], client=pipe)
        results = await pipe.execute()
        for backend, result in zip(self._backends, results, strict=True):
            self._resident[backend] = int(result[0])
            self.reclaimed_total += int(result[1])
            if result[2] is None or _text(result[2]) != self._epoch.get(backend):
                self._lost(backend, gone=result[2] is None)
                continue
            self._rebuilding_until[backend] = time.monotonic() + max(0, int(result[3])) / 1000
            self._drifted(backend, int(result[4]), int(result[5]))

    async def _listen(self) -> None:
        while not self._closing:
            try:
                assert self._client is not None
                pubsub = self._client.pubsub()
                await pubsub.subscribe(self._channel)
                try:
                    while not self._closing:
                        message = await pubsub.get_message(
                            ignore_subscribe_messages=True, timeout=0.2
                        )
                        if message is None:
                            continue
                        backend = message["data"].decode()
                        value = await self._client.get(self.keys(backend)[0])
                        self._resident[backend] = int(value or 0)
                        for callback in self._listeners:
                            callback(backend)
                finally:
                    # Bounded: closing a pub/sub connection mid-read can otherwise hang
                    # a cancelled task (and with it, shutdown).
                    with contextlib.suppress(*_CONNECTION_ERRORS, TimeoutError):
                        async with asyncio.timeout(1.0):
                            await pubsub.aclose()  # type: ignore[no-untyped-call]
            except _CONNECTION_ERRORS:
                await asyncio.sleep(self._refresh_s)
