"""Which prefix blocks a backend's engine probably still caches after their requests end.

vLLM v1 keeps a released block's KV in its free queue, evicting least recently used
ones only when a new block is needed, and a later request with the same prefix hits
it without computing it again. kvgate cannot see that cache, so it keeps a model of
it per backend: the keys of the blocks its own answered leases held there, least
recently released first, bounded by the pool's size in blocks (the engine can never
cache more than its pool). Placement reads it to prefer the backend that would hit a
longer prefix; the ledger never does (a cached free block is free capacity, charged
to the lease that takes it again like any other block).

Every answered lease's keys are remembered when it is released, shared or not, so a
unique prompt's ~60 keys are remembered too. Rather than an `OrderedDict` (a linked node
per key besides its dict slot, and a Python-level loop to move or insert each), the order
is a list of remember events read from a moving head, and a plain dict counts each key's
events in it: half the memory a key. A release whose keys are all new (every unique
prompt) is a few C-level bulk calls, and so is the eviction it causes at steady state:
the events it takes off the head are sliced at once, and where each was its key's only
one (a unique prompt's keys), their keys are deleted in one C-level pass; a key
remembered again since (a shared prefix) takes the per-key path. With a 262,144-token
pool in 16-token blocks, a 1,000-token unique prompt's acquire-answer-release through
the admission controller went from 73-92 to 43-52 us (in-process, 4,000 requests, three
alternating rounds): the per-key eviction loop was half of what its block keys cost.
What stays is probing a table as large as the pool in blocks: memory-bound, whatever
holds it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from itertools import islice

__all__ = ["RecentBlocks"]


class RecentBlocks:
    """A bounded LRU of block keys."""

    __slots__ = ("_events", "_head", "_keys", "capacity_blocks")

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = max(0, capacity_blocks)
        # key -> how many times it is in `_events[_head:]`; its last one is its place
        self._keys: dict[str, int] = {}
        # remembered keys, least recent first, from `_head` on (those before are gone:
        # dropped in bulk once they are most of the list)
        self._events: list[str] = []
        self._head = 0

    def __len__(self) -> int:
        return len(self._keys)

    def remember(self, keys: Iterable[str]) -> list[str]:
        """Blocks just released (or just used): the most recent, so the last evicted.
        -> the keys that came in or were evicted: what `leading` answers differently
        for (`proxy.prefix_view` forgets the figures that read them)."""
        if not isinstance(keys, tuple | list):
            keys = tuple(keys)
        cache = self._keys
        fresh = dict.fromkeys(keys, 1)
        if len(fresh) == len(keys) and cache.keys().isdisjoint(fresh):  # all new
            cache.update(fresh)
            moved = list(keys)
        else:
            moved = []
            for key in keys:
                n = cache.get(key)
                if n is None:
                    cache[key] = 1
                    moved.append(key)
                else:
                    cache[key] = n + 1
        self._events.extend(keys)
        if len(cache) > self.capacity_blocks:
            self._evict(moved)
        if len(self._events) - self._head > 2 * len(self._keys) + 1024:
            self._compact()  # O(events), after at least as many new ones
        elif self._head > 4096 and 2 * self._head > len(self._events):
            del self._events[:self._head]  # one memmove, after as many pops
            self._head = 0
        return moved

    def _evict(self, moved: list[str]) -> None:
        """Drop least recent keys to the capacity: a key's earlier events are skipped
        (it was remembered again since), its last one evicts it. Each pass takes as
        many events off the head as there are keys too many; none of them can free
        more keys than that, so nothing past the capacity is evicted."""
        cache = self._keys
        events = self._events
        while (over := len(cache) - self.capacity_blocks) > 0:
            head = self._head
            batch = events[head:head + over]
            self._head = head + len(batch)
            if max(map(cache.__getitem__, batch)) == 1:  # each its key's only event
                deque(map(cache.__delitem__, batch), maxlen=0)
                moved += batch
                continue
            for key in batch:
                n = cache[key] - 1
                if n:
                    cache[key] = n
                else:
                    del cache[key]
                    moved.append(key)

    def _compact(self) -> None:
        """Keys remembered again and again (a common system prompt) while nothing is
        evicted leave stale events: keep each key's last one only, in order."""
        latest = list(dict.fromkeys(reversed(self._events[self._head:])))  # most recent first
        latest.reverse()
        self._events = latest
        self._head = 0
        self._keys = dict.fromkeys(latest, 1)

    def leading(self, keys: Sequence[str], start: int = 0) -> int:
        """How many of `keys` from `start` on, in order, it holds."""
        n = 0
        cache = self._keys
        for key in islice(keys, start, None):  # no copy of a long prompt's keys
            if key not in cache:
                break
            n += 1
        return n
