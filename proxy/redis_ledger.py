"""The shared ledger: several proxy replicas, one ceiling per backend, in Redis.

Keys and scripts: `proxy.redis_scripts`. This module answers the `Ledger` calls; the
tasks that keep this replica's leases registered between calls (renewals, the refresh
pass, the release worker, the pub/sub listener, loss and rebuild): `proxy.redis_upkeep`.

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
worker task, which runs releases and renewals in order and retries them while Redis
cannot be reached. While it cannot, `reserve()` raises `LedgerUnavailable`: kvgate
never admits blindly. An error reply (a WRONGTYPE, a script's error, a NOSCRIPT that
loading the script does not fix) is no outage: the operation it answers is logged
and settled alone, not retried (`proxy.redis_upkeep.refused` says how, and why).

Release notifications go over pub/sub (`<prefix>:released`, payload = backend), so
a waiter on replica B wakes when replica A releases; a periodic refresh covers a
lost message.

Where prefixes live, for placement: this replica's own leases at once, and every
replica's as Redis holds them, read every `prefix_mirror_interval_s`
(`proxy.prefix_mirror`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from proxy.chain_pins import ChainPins
from proxy.errors import LedgerUnavailable
from proxy.prefix_mirror import PrefixMirror
from proxy.redis_faults import REDIS_ERRORS, unreachable
from proxy.redis_policy import UnsafeRedisConfig
from proxy.redis_refresh import RefreshingUpkeep
from proxy.redis_scripts import ATTACH_LUA, LOST, RESERVE_LUA, RESIZE_LUA
from proxy.redis_upkeep import KEY_CHARS, LiveLease, Op, ResidentView, as_text

__all__ = ["RedisLedger", "UnsafeRedisConfig"]

log = logging.getLogger("kvgate.ledger")


def default_recovery_window_s(lease_ttl_s: float, refresh_interval_s: float) -> float:
    """How long a rebuilt ledger refuses admission while the other replicas re-register
    their leases: three refresh passes (each replica re-registers on the first pass
    that sees the loss), at least 1 s, but no longer than a renewal period plus a pass,
    by when every live replica has re-registered by renewing anyway."""
    return min(lease_ttl_s / 3 + refresh_interval_s, max(1.0, 3 * refresh_interval_s))


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
        prefix_mirror_interval_s: float = 1.0,
    ) -> None:
        if lease_ttl_s <= 0:
            raise ValueError(f"`lease_ttl_s` must be > 0. Given: {lease_ttl_s}")
        if recovery_window_s is None:
            recovery_window_s = default_recovery_window_s(lease_ttl_s, refresh_interval_s)
        if recovery_window_s < 0:
            raise ValueError(f"`recovery_window_s` must be >= 0. Given: {recovery_window_s}")
        if prefix_mirror_interval_s < 0:
            raise ValueError("`prefix_mirror_interval_s` must be >= 0 (0: off). Given: "
                             f"{prefix_mirror_interval_s}")
        self._url = url
        self._backends = list(backends)
        self._prefix = key_prefix
        self._ttl_ms = int(lease_ttl_s * 1000)
        self._refresh_s = refresh_interval_s
        self._socket_timeout_s = socket_timeout_s
        self._window_s = recovery_window_s
        self._channel = f"{key_prefix}:released"
        self._resident = ResidentView(self._backends)
        self._live: dict[str, LiveLease] = {}
        # per backend, the blocks this replica's live leases reference (pinned, as the
        # scripts pin them in Redis) and those of them ready: what placement reads (the
        # reserve script decides on Redis' own)
        self._local_refs: dict[str, ChainPins] = {b: ChainPins() for b in self._backends}
        self._local_ready: dict[str, set[str]] = {b: set() for b in self._backends}
        self._block_tokens: dict[str, int] = {}
        # and every replica's, as Redis holds them (`proxy.prefix_mirror`)
        self._mirror = PrefixMirror(self.keys)
        self._mirror_s = prefix_mirror_interval_s
        # releases, ready marks and renewals for the upkeep's worker, in order
        self._ops: asyncio.Queue[Op] = asyncio.Queue()
        # the epoch each backend's leases were last registered under: the upkeep learns
        # it from each renewal, the reserve and resize scripts check it
        self._epoch: dict[str, str] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._client: aioredis.Redis | None = None
        self._closing = False
        self._upkeep = RefreshingUpkeep(
            backends=self._backends, keys=self.keys, channel=self._channel,
            ttl_ms=self._ttl_ms, refresh_s=refresh_interval_s, window_s=recovery_window_s,
            live=self._live, resident=self._resident, epoch=self._epoch, ops=self._ops,
            closing=lambda: self._closing,
        )

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
        self._resize = self._client.register_script(RESIZE_LUA)
        self._attach = self._client.register_script(ATTACH_LUA)
        self._upkeep.attach(self._client)
        if not await self._upkeep.connect():
            log.warning("shared ledger is UNREACHABLE at start: %s", self._url_for_log())
        loop = asyncio.get_running_loop()
        # close() cancels all but the listener, which stops on `_closing`
        self._tasks = [
            loop.create_task(self._upkeep.worker()),
            loop.create_task(self._upkeep.maintain()),
        ]
        if self._mirror_s > 0:
            self._tasks.append(loop.create_task(
                self._mirror.run(self._client, self._backends, self._mirror_s)))
        self._tasks.append(loop.create_task(self._upkeep.listen()))
        wait_s = self._upkeep.rebuilding_left_s()
        if wait_s > 0:
            log.warning("shared ledger is being rebuilt: admitting in %.1f s", wait_s)
        # A renewal meanwhile may move the window's end, and a timer may fire a hair
        # before it: wait until it has passed (a few passes at most).
        for _ in range(8):
            if (wait_s := self._upkeep.rebuilding_left_s()) <= 0:
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
        for task in self._tasks[:-1]:
            task.cancel()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(3.0):
                await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

    async def check_eviction_policy(self) -> str | None:
        """-> why Redis may evict the ledger's keys, or None (`proxy.redis_policy`)."""
        return await self._upkeep.check_eviction_policy()

    def _url_for_log(self) -> str:
        # no password in logs: redis://user:secret@host -> redis://host
        scheme, sep, rest = self._url.partition("://")
        return f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else self._url

    # ------------------------------------------------------------------ counters
    @property
    def reclaimed_total(self) -> int:
        """Expired leases this replica's refresh passes and renewals reclaimed."""
        return self._upkeep.reclaimed_total

    @property
    def readded_total(self) -> int:
        """Live leases this replica re-registered after Redis lost them."""
        return self._upkeep.readded_total

    @property
    def rebuilds_total(self) -> int:
        """Epochs this replica started (a loss, or a first start)."""
        return self._upkeep.rebuilds_total

    @property
    def drift_fixed_total(self) -> int:
        """Tokens the resident counters were off by, repaired."""
        return self._upkeep.drift_fixed_total

    # ------------------------------------------------------------------ protocol
    @property
    def available(self) -> bool:
        """False while Redis cannot be reached, until this replica has registered its
        leases again after losing contact or data, and while the ledger is being rebuilt."""
        return self._upkeep.available

    @property
    def recovery_window_s(self) -> float:
        return self._window_s

    def add_listener(self, callback: Callable[[str], None]) -> None:
        """Called with a backend name whenever capacity there may have come back."""
        self._upkeep.add_listener(callback)

    def add_prefix_listener(self, callback: Callable[[str], None]) -> None:
        """Called with a backend name when the mirror of what every replica holds ready
        there changed (`proxy.prefix_mirror`)."""
        self._mirror.add_listener(callback)

    def keys(self, backend: str) -> list[str]:
        tag = f"{self._prefix}:{{{backend}}}"
        return [f"{tag}:resident", f"{tag}:leases", f"{tag}:expiry", f"{tag}:refs",
                f"{tag}:ready"]

    async def reserve(self, backend: str, lease_id: str, tokens: int, capacity: int,
                      blocks: Sequence[str] = (), block_tokens: int = 0) -> bool:
        if lease_id[:1] in ("=", "#"):
            raise ValueError(f"lease ids may not start with '=' or '#': {lease_id!r}")
        if blocks and {*map(len, blocks)} != {KEY_CHARS}:
            raise ValueError(f"block keys are {KEY_CHARS} hex digits")
        if blocks and block_tokens * len(blocks) > tokens:
            raise ValueError(f"{len(blocks)} blocks of {block_tokens} tokens exceed the "
                             f"lease's {tokens} tokens")
        distinct = tuple(dict.fromkeys(blocks))  # a key twice in one prompt is one block
        mark = self._resident.mark(backend)
        try:
            result = await self._reserve(
                keys=self.keys(backend),
                args=[lease_id, tokens, capacity, self._ttl_ms, self._channel, backend,
                      self._epoch.get(backend, ""), block_tokens if distinct else 0,
                      "".join(distinct)],
            )
        except asyncio.CancelledError:
            # The script may have run: undo it (the release script ignores unknown leases).
            self._ops.put_nowait(("release", backend, lease_id))
            raise
        except REDIS_ERRORS as exc:
            # The script may have run and only its reply was lost (a timeout, a
            # connection cut after the retry), or failed midway (Redis keeps what a
            # script wrote before its error): undo it like a cancelled reserve, or the
            # capacity would be held by nobody until the TTL.
            self._ops.put_nowait(("release", backend, lease_id))
            if not unreachable(exc):
                # An error reply (`proxy.redis_upkeep.refused`): Redis is there, this
                # backend's ledger does not work. Its details go to the log, not to
                # the client.
                self._upkeep.say_refused("reserve", backend, lease_id, exc,
                                         "answered 503 ledger_unavailable")
                raise LedgerUnavailable(
                    f"the shared ledger of {backend!r} refused the reserve (an error "
                    "reply from Redis, logged); kvgate does not admit without it",
                    retry_after_s=self._refresh_s * 4,
                ) from exc
            self._upkeep.set_reachable(False, exc)
            raise LedgerUnavailable(
                f"the shared ledger cannot be reached ({type(exc).__name__}); "
                "kvgate does not admit without it",
                retry_after_s=self._refresh_s * 4,
            ) from exc
        self._upkeep.set_reachable(True)
        status = int(result[0])
        if status <= LOST:
            raise self._upkeep.refusal(backend, status, int(result[1]))
        resident = int(result[1])
        self._resident.read(backend, resident, mark)
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
            # Register what the first run recorded: the keys its record references
            # (not all those brought, where some were registered but not ready then).
            # What ready blocks covered then is not recorded: `shared` stays 0.
            status, result = 1, [1, resident, 0, result[3], result[4]]
        if status == 1 and lease_id not in self._live:
            self._record(lease_id, backend, tokens, distinct, block_tokens, result)
        return status == 1

    def _record(self, lease_id: str, backend: str, tokens: int, blocks: Sequence[str],
                block_tokens: int, result: list[Any]) -> None:
        """What the script registered: it references the first `result[3]` of the
        distinct keys brought (a key registered but not ready is paid in full, not
        referenced, with every key after it). A retry's "already recorded" reply sends
        the list its record holds."""
        live = LiveLease(backend, tokens, shared=int(result[2]))
        if nrefs := int(result[3]):
            which = as_text(result[4]) if len(result) > 4 else ""
            refs = (tuple(which[i:i + KEY_CHARS] for i in range(0, len(which), KEY_CHARS))
                    if which else tuple(blocks[:nrefs]))
            pins = self._local_refs.get(backend)
            if pins is None:  # a backend named after start: both views made here, once
                pins = self._local_refs[backend] = ChainPins()
                self._local_ready[backend] = set()
            pins.add(refs)
            live.ref_keys = refs
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
        mark = self._resident.mark(backend)
        try:
            result = await self._resize(
                keys=self.keys(backend),
                args=[lease_id, tokens - live.ref_tokens, capacity, self._channel, backend,
                      self._epoch.get(backend, "")],
            )
        except REDIS_ERRORS as exc:
            # The lease keeps its recorded size; the request itself goes on.
            self._failed("resize", backend, lease_id, exc, "the lease keeps its size")
            return live.tokens
        self._upkeep.set_reachable(True)
        granted = int(result[0])
        if granted <= LOST:
            # Rebuilding: nothing changed; the lease keeps the size it is registered with.
            self._upkeep.refusal(backend, granted, int(result[1]))
            return live.tokens if lease_id in self._live else 0
        self._resident.read(backend, int(result[1]), mark)
        if lease_id not in self._live:
            return 0  # released here while the script ran; the release script follows
        if granted < 0:
            # Redis lost a live lease (restart, outage past the TTL): the next renewal
            # re-adds it at the size recorded here.
            return live.tokens
        live.tokens = granted + live.ref_tokens
        return live.tokens

    async def attach(self, lease_id: str, blocks: Sequence[str], block_tokens: int) -> int:
        live = self._live.get(lease_id)
        if live is None or live.refs or not blocks or not self.available:
            return 0  # (Redis down or rebuilding: the lease stays charged in full)
        if {*map(len, blocks)} != {KEY_CHARS}:
            raise ValueError(f"block keys are {KEY_CHARS} hex digits")
        distinct = tuple(dict.fromkeys(blocks))  # a key twice in one prompt is one block
        if block_tokens * len(distinct) > live.tokens:
            raise ValueError(f"{len(distinct)} blocks of {block_tokens} tokens exceed the "
                             f"lease's {live.tokens} tokens")
        backend = live.backend
        try:
            result = await self._attach(
                keys=self.keys(backend),
                args=[lease_id, block_tokens, "".join(distinct), self._epoch.get(backend, "")])
        except REDIS_ERRORS as exc:
            # Either way the lease stays registered as it was (a script that ran and
            # lost its reply left Redis charging the same tokens, resident unchanged);
            # this replica's view keeps it unshared, and its release drops what it holds.
            self._failed("attach", backend, lease_id, exc, "the lease stays charged in full")
            return 0
        self._upkeep.set_reachable(True)
        n = int(result[0])
        if n <= LOST:
            self._upkeep.refusal(backend, n, int(result[1]))
            return 0
        if n == 0 or self._live.get(lease_id) is not live or live.refs:
            return 0  # held already here; or released here while the script ran
        refs = distinct[:n]
        pins = self._local_refs.get(backend)
        if pins is None:
            pins = self._local_refs[backend] = ChainPins()
            self._local_ready[backend] = set()
        pins.add(refs)
        live.ref_keys = refs
        live.refs = f"{block_tokens}|{''.join(refs)}"
        live.ref_tokens = block_tokens * n
        live.block_tokens = block_tokens
        self._block_tokens[backend] = block_tokens
        return n

    def _failed(self, op: str, backend: str, lease_id: str, exc: Exception, what: str) -> None:
        """A script that failed on a live lease, which goes on as `what` says: Redis
        unreachable, or an error reply (logged)."""
        if unreachable(exc):
            self._upkeep.set_reachable(False, exc)
        else:
            self._upkeep.say_refused(op, backend, lease_id, exc, what)

    def release(self, lease_id: str) -> None:
        live = self._live.pop(lease_id, None)
        if live is None:
            return
        backend = live.backend
        try:  # this replica's view first; Redis' release is queued whatever happens to it
            freed = live.own
            if live.ref_keys:
                gone = self._local_refs[backend].remove(live.ref_keys)
                if gone:
                    self._local_ready[backend].difference_update(gone)
                    # as far as this replica knows; Redis' reply corrects it
                    freed += live.block_tokens * len(gone)
            self._resident.released(backend, freed)
        finally:
            self._ops.put_nowait(("release", backend, lease_id))

    def mark_ready(self, lease_id: str) -> None:
        live = self._live.get(lease_id)
        if live is None or live.ready or not live.refs:
            return
        live.ready = True
        self._local_ready[live.backend].update(live.ref_keys)  # made with its pins
        self._ops.put_nowait(("ready", live.backend, lease_id))

    def shared_tokens(self, lease_id: str) -> int:
        live = self._live.get(lease_id)
        return 0 if live is None else live.shared

    def ready_blocks(self, backend: str, blocks: Sequence[str]) -> int:
        """From this replica's own live leases, and the mirror of every replica's: what
        placement needs is a good guess of where a prefix lives; the reserve script
        charges from Redis' exact refs. Both sets are closed towards the root, and so
        is their union (the binary search of `leading_run`)."""
        return self._mirror.leading(backend, blocks, self._local_ready.get(backend) or ())

    def holds(self, backend: str, key: str) -> bool:
        """Referenced by a live lease of this replica (answered or not), or ready in the
        mirror of every replica's (one still in prefill elsewhere is not seen)."""
        pins = self._local_refs.get(backend)
        return (pins is not None and key in pins) or key in self._mirror.ready(backend)

    def shared_resident(self, backend: str) -> int:
        """Blocks live leases reference: this replica's own now, or every replica's as
        the mirror last read them, whichever is more."""
        pins = self._local_refs.get(backend)
        own = (len(pins) if pins is not None else 0) * self._block_tokens.get(backend, 0)
        return max(own, self._mirror.referenced_tokens(backend))

    def resident(self, backend: str) -> int:
        return self._resident.get(backend)

    def lease_count(self, backend: str) -> int:
        return sum(1 for live in self._live.values() if live.backend == backend)

    async def resident_now(self, backend: str) -> int:
        """Read Redis directly (tests, admin)."""
        assert self._client is not None
        value = await self._client.get(self.keys(backend)[0])
        return int(value or 0)

