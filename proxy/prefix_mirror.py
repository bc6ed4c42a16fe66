"""What every replica holds ready in shared blocks, read from Redis for placement.

Placement asks where a request's prefix lives (`proxy.prefix_view`). Each replica
knows its own leases at once, but a group whose first requests came through another
replica is held on a backend this one knows nothing of: it seeds the prefix again
elsewhere, and the engines there compute and hold a second copy. Three replicas on one
Redis, G at 3x, served 0.70x and 0.75x of the same replicas with every client sent to
one of them (benchmarks/README.md, "Three replicas on one Redis"); with this mirror,
0.86x and 0.89x, the engines' prefix hit rate back at one replica's.

So each replica reads, every `interval_s`, each backend's ready set (`<prefix>:{b}:ready`,
the blocks some live lease references and has answered with) and the size of its refs
hash (every block referenced, ready or not) times its block size, in one pipelined
round trip. Placement reads the union of that and its own view: a guess of where a
prefix lives, at most one interval old. What a lease is charged is still decided by
the reserve script on Redis' exact refs, so a stale mirror costs a placement, never
the ceiling.

The cost is the ready sets' size, which the pools bound: every ready block is held in
a pool. 16-byte keys, one per block: a 16,384-token pool in 16-token blocks is at most
1,024 keys (16 kB) a pass; a 500,000-token pool at most 31,250 (0.5 MB). Backends
whose ready set is empty cost one empty reply.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Container, Sequence
from typing import Any

import redis.asyncio as aioredis

from proxy.chain_pins import leading_run
from proxy.redis_faults import REDIS_ERRORS, Repeats, fault
from proxy.redis_scripts import REFS_WIDE_FIELD

__all__ = ["PrefixMirror"]

log = logging.getLogger("kvgate.ledger")

_EMPTY: frozenset[str] = frozenset()


class _Either:
    """Membership in either of two sets, without building their union."""

    __slots__ = ("_a", "_b")

    def __init__(self, a: Container[str], b: Container[str]) -> None:
        self._a, self._b = a, b

    def __contains__(self, key: object) -> bool:
        return key in self._a or key in self._b


class PrefixMirror:
    """Per backend, the ready block keys and the tokens of the referenced ones, as Redis
    last said: `refresh` reads them, `ready` and `referenced_tokens` answer from the
    last read."""

    __slots__ = ("_keys", "_listeners", "_ready", "_referenced")

    def __init__(self, keys: Callable[[str], list[str]]) -> None:
        self._keys = keys  # a backend's Redis keys (`RedisLedger.keys`)
        self._ready: dict[str, frozenset[str]] = {}
        self._referenced: dict[str, int] = {}
        self._listeners: list[Callable[[str], None]] = []

    def add_listener(self, callback: Callable[[str], None]) -> None:
        """`callback(backend)` after a refresh that changed its ready set."""
        self._listeners.append(callback)

    def ready(self, backend: str) -> frozenset[str]:
        return self._ready.get(backend, _EMPTY)

    def leading(self, backend: str, blocks: Sequence[str], own: Container[str]) -> int:
        """How many leading `blocks` are ready here or in `own` (this replica's ready
        ones). Both are closed towards the root, and so is their union: the binary
        search of `leading_run` holds."""
        ready = self._ready.get(backend)
        return leading_run(blocks, _Either(own, ready) if ready else own)

    def referenced_tokens(self, backend: str) -> int:
        """Tokens of the distinct blocks live leases reference there, ready or not."""
        return self._referenced.get(backend, 0)

    async def run(self, client: aioredis.Redis, backends: Sequence[str],
                  interval_s: float) -> None:
        """Refresh every interval; tell the listeners what changed. A read that fails
        keeps the last one (placement's guess, never a charge); the ledger's refresh
        pass is what notices and reports an outage. Anything else it raises (a bug, a
        reply it cannot read) is logged (once per 30 s while it repeats: `Repeats`), and
        the loop goes on."""
        repeats = Repeats()
        while True:
            await asyncio.sleep(interval_s)
            try:
                changed = await self.refresh(client, backends)
            except REDIS_ERRORS:
                continue
            except Exception as exc:
                repeats.log(("prefix mirror", *fault(exc)), logging.ERROR,
                            "shared ledger: reading where the other replicas hold "
                            "prefixes failed; tried again every %.1f s", interval_s,
                            exc_info=exc)
                continue
            for backend in changed:
                for callback in self._listeners:
                    try:
                        callback(backend)
                    except Exception:
                        log.exception("a prefix listener failed on %s", backend)

    async def refresh(self, client: aioredis.Redis, backends: Sequence[str]) -> list[str]:
        """Read every backend's ready set and refs count in one round trip; -> the
        backends whose ready set changed. Raises Redis' errors (the caller's loop
        keeps the last read)."""
        pipe = client.pipeline(transaction=False)
        for backend in backends:
            keys = self._keys(backend)
            pipe.smembers(keys[4])
            pipe.hlen(keys[3])
            pipe.hexists(keys[3], REFS_WIDE_FIELD)
            pipe.hget(keys[1], "=bt")
        replies: list[Any] = await pipe.execute()
        # read all before changing anything: a reply that cannot be read leaves the last
        # read whole (the listeners are told of every change, or of none)
        read = []
        for i, backend in enumerate(backends):
            members, fields, wide, bt = replies[4 * i: 4 * i + 4]
            ready = frozenset(m.decode() if isinstance(m, bytes) else str(m) for m in members)
            blocks = max(0, int(fields) - (1 if wide else 0))
            read.append((backend, ready, blocks * int(bt or 0)))
        changed = []
        for backend, ready, referenced in read:
            self._referenced[backend] = referenced
            if ready != self._ready.get(backend, _EMPTY):
                self._ready[backend] = ready
                changed.append(backend)
        return changed
