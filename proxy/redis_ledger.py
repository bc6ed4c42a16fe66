"""The shared ledger: several proxy replicas, one ceiling per backend, in Redis.

Per backend, three keys share the hash tag `{backend}` (so the scripts run on one
Redis Cluster slot); `key_prefix` keeps deployments apart on one server:

    <prefix>:{<backend>}:resident   integer, tokens reserved now
    <prefix>:{<backend>}:leases     hash lease_id -> tokens
    <prefix>:{<backend>}:expiry     zset lease_id -> expiry (Redis server ms)

Each operation is one Lua script, one round trip, atomic. Expiry uses the Redis
server's clock (TIME), never a replica's, so clock skew between replicas cannot
reclaim live leases early.

Leases carry a TTL; the owning replica renews its live leases every ttl/3. A
crashed or partitioned replica stops renewing, and every replica's refresh pass
(each `refresh_interval_s`) reclaims expired leases, as does any reserve. Worst-case
time to reclaim after a crash: lease_ttl_s + refresh_interval_s (30.5 s with the
defaults), plus one round trip.

A reserve whose reply never came (cancelled, timed out, connection cut) queues its
own undo: the script may have run, and the release script ignores unknown leases.

Renewal also re-adds a live lease that Redis no longer has (a Redis restart
without persistence, or an outage longer than the TTL), so resident tokens equal
the leases really in use once Redis is back: nothing lost, nothing counted twice.

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
from collections.abc import Callable, Iterable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from proxy.errors import LedgerUnavailable

__all__ = ["RedisLedger"]

log = logging.getLogger("kvgate.ledger")

# Shared prologue: reclaim expired leases of this backend, by Redis server time.
# KEYS[1] resident, KEYS[2] leases hash, KEYS[3] expiry zset
_RECLAIM = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expired = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
for _, id in ipairs(expired) do
  local tok = redis.call('HGET', KEYS[2], id)
  if tok then
    redis.call('DECRBY', KEYS[1], tok)
    redis.call('HDEL', KEYS[2], id)
  end
  redis.call('ZREM', KEYS[3], id)
end
"""

# ARGV[1] lease id, ARGV[2] tokens, ARGV[3] capacity, ARGV[4] ttl ms,
# ARGV[5] channel, ARGV[6] backend
# returns {1 reserved | 0 no room | -1 lease id already recorded, resident after,
#          tokens recorded under that lease id (for -1)}
RESERVE_LUA = _RECLAIM + """
if #expired > 0 then redis.call('PUBLISH', ARGV[5], ARGV[6]) end
local resident = tonumber(redis.call('GET', KEYS[1]) or '0')
local recorded = redis.call('HGET', KEYS[2], ARGV[1])
if recorded then return {-1, resident, tonumber(recorded)} end
local tokens = tonumber(ARGV[2])
if resident + tokens > tonumber(ARGV[3]) then return {0, resident} end
redis.call('INCRBY', KEYS[1], tokens)
redis.call('HSET', KEYS[2], ARGV[1], tokens)
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[4]), ARGV[1])
return {1, resident + tokens}
"""

# ARGV[1] channel, ARGV[2] backend
# returns {resident after, leases reclaimed}: the refresh pass, so expired leases go on
# the refresh schedule even when no replica reserves or renews on this backend.
RECLAIM_LUA = _RECLAIM + """
if #expired > 0 then redis.call('PUBLISH', ARGV[1], ARGV[2]) end
return {tonumber(redis.call('GET', KEYS[1]) or '0'), #expired}
"""

# ARGV[1] lease id, ARGV[2] channel, ARGV[3] backend
# returns {1 released | 0 unknown (already released or reclaimed), resident after}
RELEASE_LUA = """
local tok = redis.call('HGET', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
if not tok then
  return {0, tonumber(redis.call('GET', KEYS[1]) or '0')}
end
redis.call('HDEL', KEYS[2], ARGV[1])
local resident = redis.call('DECRBY', KEYS[1], tok)
redis.call('PUBLISH', ARGV[2], ARGV[3])
return {1, resident}
"""

# ARGV[1] lease id, ARGV[2] wanted tokens, ARGV[3] capacity, ARGV[4] channel, ARGV[5] backend
# returns {tokens the lease holds now (-1: unknown lease), resident after}
# Shrinking always succeeds (and wakes waiters); growing takes only free room.
RESIZE_LUA = """
local resident = tonumber(redis.call('GET', KEYS[1]) or '0')
local held = redis.call('HGET', KEYS[2], ARGV[1])
if not held then return {-1, resident} end
held = tonumber(held)
local wanted = tonumber(ARGV[2])
local granted = wanted
if wanted > held then
  granted = math.min(wanted, held + math.max(0, tonumber(ARGV[3]) - resident))
end
if granted ~= held then
  resident = redis.call('INCRBY', KEYS[1], granted - held)
  redis.call('HSET', KEYS[2], ARGV[1], granted)
  if granted < held then redis.call('PUBLISH', ARGV[4], ARGV[5]) end
end
return {granted, resident}
"""

# ARGV[1] ttl ms, ARGV[2] channel, ARGV[3] backend, then pairs: lease id, tokens
# returns {resident after, leases reclaimed, live leases re-added}
RENEW_LUA = _RECLAIM + """
if #expired > 0 then redis.call('PUBLISH', ARGV[2], ARGV[3]) end
local readded = 0
for i = 4, #ARGV, 2 do
  local id = ARGV[i]
  if redis.call('HEXISTS', KEYS[2], id) == 0 then
    redis.call('HSET', KEYS[2], id, ARGV[i + 1])
    redis.call('INCRBY', KEYS[1], ARGV[i + 1])
    readded = readded + 1
  end
  redis.call('ZADD', KEYS[3], now + tonumber(ARGV[1]), id)
end
return {tonumber(redis.call('GET', KEYS[1]) or '0'), #expired, readded}
"""

_CONNECTION_ERRORS = (RedisError, OSError, asyncio.TimeoutError)


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
    ) -> None:
        if lease_ttl_s <= 0:
            raise ValueError(f"`lease_ttl_s` must be > 0. Given: {lease_ttl_s}")
        self._url = url
        self._backends = list(backends)
        self._prefix = key_prefix
        self._ttl_ms = int(lease_ttl_s * 1000)
        self._refresh_s = refresh_interval_s
        self._socket_timeout_s = socket_timeout_s
        self._channel = f"{key_prefix}:released"
        self._resident: dict[str, int] = dict.fromkeys(self._backends, 0)
        self._live: dict[str, tuple[str, int]] = {}
        self._ops: asyncio.Queue[tuple[str, str, str]] = asyncio.Queue()
        self._listeners: list[Callable[[str], None]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._client: aioredis.Redis | None = None
        self._available = False
        self._closing = False
        self.reclaimed_total = 0
        self.readded_total = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
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
        with contextlib.suppress(*_CONNECTION_ERRORS):
            await self._client.ping()
            self._available = True
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._worker()),
            loop.create_task(self._maintain()),
            loop.create_task(self._listen()),
        ]

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

    # ------------------------------------------------------------------ protocol
    @property
    def available(self) -> bool:
        return self._available

    def add_listener(self, callback: Callable[[str], None]) -> None:
        """Called with a backend name whenever capacity there may have come back."""
        self._listeners.append(callback)

    def keys(self, backend: str) -> list[str]:
        tag = f"{self._prefix}:{{{backend}}}"
        return [f"{tag}:resident", f"{tag}:leases", f"{tag}:expiry"]

    async def reserve(self, backend: str, lease_id: str, tokens: int, capacity: int) -> bool:
        try:
            result = await self._reserve(
                keys=self.keys(backend),
                args=[lease_id, tokens, capacity, self._ttl_ms, self._channel, backend],
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
            self._set_available(False, exc)
            raise LedgerUnavailable(
                f"the shared ledger cannot be reached ({type(exc).__name__}); "
                "kvgate does not admit without it",
                retry_after_s=self._refresh_s * 4,
            ) from exc
        self._set_available(True)
        status, resident = int(result[0]), int(result[1])
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
            status = 1
        if status == 1:
            self._live[lease_id] = (backend, tokens)
        return status == 1

    async def resize(self, lease_id: str, tokens: int, capacity: int) -> int:
        entry = self._live.get(lease_id)
        if entry is None:
            return 0
        backend, size = entry
        if not self._available:
            # Redis is known to be down: the lease keeps its size at once, rather than
            # each resize (the tick, dispatch) waiting out a socket timeout in turn.
            # Reserves and the refresh pass find out when it is back.
            return size
        try:
            result = await self._resize(
                keys=self.keys(backend),
                args=[lease_id, tokens, capacity, self._channel, backend],
            )
        except _CONNECTION_ERRORS as exc:
            # The lease keeps its recorded size; the request itself goes on.
            self._set_available(False, exc)
            return self._live.get(lease_id, entry)[1]
        self._set_available(True)
        granted, resident = int(result[0]), int(result[1])
        self._resident[backend] = resident
        if lease_id not in self._live:
            return 0  # released here while the script ran; the release script follows
        if granted < 0:
            # Redis lost a live lease (restart, outage past the TTL): the next renewal
            # re-adds it at the size recorded here.
            return self._live[lease_id][1]
        self._live[lease_id] = (backend, granted)
        return granted

    def release(self, lease_id: str) -> None:
        entry = self._live.pop(lease_id, None)
        if entry is None:
            return
        backend, tokens = entry
        self._resident[backend] = max(0, self._resident.get(backend, 0) - tokens)
        self._ops.put_nowait(("release", backend, lease_id))

    def resident(self, backend: str) -> int:
        return self._resident.get(backend, 0)

    def lease_count(self, backend: str) -> int:
        return sum(1 for b, _ in self._live.values() if b == backend)

    async def resident_now(self, backend: str) -> int:
        """Read Redis directly (tests, admin)."""
        assert self._client is not None
        value = await self._client.get(self.keys(backend)[0])
        return int(value or 0)

    # ------------------------------------------------------------------ background
    def _set_available(self, available: bool, error: BaseException | None = None) -> None:
        if available == self._available:
            return
        self._available = available
        if not available:
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
        a burst of N releases costs one round trip, not N.
        """
        while True:
            batch = [await self._ops.get()]
            while len(batch) < 512 and not self._ops.empty():
                batch.append(self._ops.get_nowait())
            try:
                delay = 0.05
                while True:
                    try:
                        await self._run_batch(batch)
                        self._set_available(True)
                        break
                    except _CONNECTION_ERRORS as exc:
                        self._set_available(False, exc)
                        await asyncio.sleep(delay)
                        delay = min(1.0, delay * 2)
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
            else:
                await self._renew(keys=self.keys(backend), args=self._renew_args(backend),
                                  client=pipe)
        results = await pipe.execute()
        for (kind, backend, _), result in zip(batch, results, strict=True):
            if kind == "release":
                self._resident[backend] = int(result[1])
                continue
            self._resident[backend] = int(result[0])
            self.reclaimed_total += int(result[1])
            self.readded_total += int(result[2])
            if int(result[2]):
                log.warning("re-added %d live leases on %s after Redis lost them",
                            int(result[2]), backend)

    def _renew_args(self, backend: str) -> list[Any]:
        args: list[Any] = [self._ttl_ms, self._channel, backend]
        for lease_id, (b, tokens) in list(self._live.items()):
            if b == backend:
                args += [lease_id, tokens]
        return args

    async def _maintain(self) -> None:
        """Renew leases every ttl/3, reclaim expired ones, refresh the resident view."""
        renew_every_s = self._ttl_ms / 3000
        since_renew = renew_every_s
        while True:
            if since_renew >= renew_every_s or not self._available:
                for backend in self._backends:
                    self._ops.put_nowait(("renew", backend, ""))
                since_renew = 0.0
            else:
                with contextlib.suppress(*_CONNECTION_ERRORS):
                    await self._reclaim_expired()
            # Waiters re-check after each pass: this covers a lost pub/sub message.
            self._notify_all()
            await asyncio.sleep(self._refresh_s)
            since_renew += self._refresh_s

    async def _reclaim_expired(self) -> None:
        """One pipelined pass: reclaim expired leases, refresh the resident view."""
        assert self._client is not None
        pipe = self._client.pipeline(transaction=False)
        for backend in self._backends:
            await self._reclaim(keys=self.keys(backend), args=[self._channel, backend],
                                client=pipe)
        results = await pipe.execute()
        for backend, result in zip(self._backends, results, strict=True):
            self._resident[backend] = int(result[0])
            self.reclaimed_total += int(result[1])

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
