"""Keys of hash chains held by live leases, each key once, kept by pins.

A lease's block keys are a hash chain (`proxy.prefix_blocks`: a key stands for its
block and every block before it), and a lease references a leading run of its chain.
The keys held on a backend so form a tree, and each key needs one number: its pins,
the leases whose run ends at it plus its held children. A lease that joins a held
run pins its last key only, and its release unpins it: O(log n) for a run of n keys
held already (a binary search: the held keys are closed towards the root), rather
than a count per key written on reserve and again on release. What the Redis
ledger's scripts keep in Redis (`proxy.redis_scripts`), kept here for one replica's
own view of its leases.

Runs must be chains: a key's parent is the key before it in every run that holds it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Sequence

__all__ = ["ChainPins", "leading_run"]


def leading_run(keys: Sequence[str], held: Container[str]) -> int:
    """How many leading `keys` are in `held`, for a `held` closed towards the root of
    the chain (true of the first that many keys, false of all after): a binary search."""
    lo, hi = 0, len(keys)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if keys[mid - 1] in held:
            lo = mid
        else:
            hi = mid - 1
    return lo


class ChainPins:
    """key -> pins, for the runs of live leases (`add`, `remove`, each once a run)."""

    __slots__ = ("pins",)

    def __init__(self) -> None:
        self.pins: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.pins)

    def __contains__(self, key: object) -> bool:
        return key in self.pins

    def add(self, run: Sequence[str]) -> int:
        """Hold `run`; -> how many of its keys were not held before."""
        if not run:
            return 0
        pins = self.pins
        held = leading_run(run, pins)
        if held == len(run):
            pins[run[-1]] += 1  # its run ends there
            return 0
        pins.update(dict.fromkeys(run[held:], 1))  # each: its child's pin, or its lease's
        if held:
            pins[run[held - 1]] += 1  # a new child
        return len(run) - held

    def remove(self, run: Sequence[str]) -> Sequence[str]:
        """Let go of `run` (as added); -> the keys no longer held: its last, and each key
        before it whose one pin was the key after it."""
        if not run:
            return ()
        pins = self.pins
        last = len(run) - 1
        left = pins[run[last]] - 1
        if left:
            pins[run[last]] = left
            return ()
        first = last
        while first > 0 and pins[run[first - 1]] == 1:
            first -= 1
        gone = run[first:]
        deque(map(pins.__delitem__, gone), maxlen=0)
        if first:
            pins[run[first - 1]] -= 1  # the child that went
        return gone
