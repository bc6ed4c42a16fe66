"""Which prefix blocks a backend's engine probably still caches after their requests end.

vLLM v1 keeps a released block's KV in its free queue, evicting least recently used
ones only when a new block is needed, and a later request with the same prefix hits
it without computing it again. kvgate cannot see that cache, so it keeps a model of
it per backend: the keys of the blocks its own answered leases held there, least
recently released first, bounded by the pool's size in blocks (the engine can never
cache more than its pool). Placement reads it to prefer the backend that would hit a
longer prefix; the ledger never does (a cached free block is free capacity, charged
to the lease that takes it again like any other block).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import islice

__all__ = ["RecentBlocks"]


class RecentBlocks:
    """A bounded LRU of block keys."""

    __slots__ = ("_keys", "capacity_blocks")

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = max(0, capacity_blocks)
        self._keys: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def remember(self, keys: Iterable[str]) -> list[str]:
        """Blocks just released (or just used): the most recent, so the last evicted.
        -> the keys that came in or were evicted: what `leading` answers differently
        for (`proxy.prefix_view` forgets the figures that read them)."""
        cache = self._keys
        moved: list[str] = []
        for key in keys:
            if key in cache:
                cache.move_to_end(key)
            else:
                cache[key] = None
                moved.append(key)
        while len(cache) > self.capacity_blocks:
            moved.append(cache.popitem(last=False)[0])
        return moved

    def leading(self, keys: Sequence[str], start: int = 0) -> int:
        """How many of `keys` from `start` on, in order, it holds."""
        n = 0
        cache = self._keys
        for key in islice(keys, start, None):  # no copy of a long prompt's keys
            if key not in cache:
                break
            n += 1
        return n
