"""One model's waiting room: who waits, in which order they are offered room, and how
many may wait.

A waiter is a queued demand, its place in the ordering policy's order (`view`) and
the future its lease is handed over by. The room is bounded in all (`max_depth`) and
per priority class (`class_depths`); when it is full, a newcomer of a higher class
takes the place of the newest waiter of the lowest class below its own
(`victim_for`), so that a flood of low priority cannot take the room of high. The
admission controller (`proxy.admission`) decides what to do with either; every waiter
enters and leaves through it, which is what tells the release rate when the queue
was empty.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import replace

from policies.ordering import Ordering, WaiterView, class_rank
from proxy.leases import Demand, Lease

__all__ = ["SPILL_AFTER", "Waiter", "WaitingRoom"]

# share of its time to deadline a waiter holds out for the backend that holds its prefix
# (`policies.placement.worth_waiting_for`) before it may go to any with room
SPILL_AFTER = 1 / 3


class Waiter:
    """A queued demand until its lease is handed over, it is refused or it gives up."""

    __slots__ = ("deadline", "demand", "fut", "view")

    def __init__(self, view: WaiterView, demand: Demand, fut: asyncio.Future[Lease],
                 deadline: float) -> None:
        self.view: WaiterView = view
        self.demand: Demand = demand
        self.fut = fut
        self.deadline = deadline

    @property
    def spill_at(self) -> float:
        """From when, held back for the backend that holds its prefix, it may go to any
        backend with room (`SPILL_AFTER`)."""
        return self.view.arrival + SPILL_AFTER * (self.deadline - self.view.arrival)

    def resize(self, tokens: int) -> None:
        """Adaptive reservation sized it anew: its place in a size-aware order moves."""
        if tokens != self.demand.tokens:
            self.demand = replace(self.demand, tokens=tokens)
            self.view = replace(self.view, demand_tokens=tokens)


class WaitingRoom:
    """The waiters in arrival order, with the bounds and the order they are served in."""

    __slots__ = ("_class_depths", "_ordering", "_seq", "_waiters", "max_depth")

    def __init__(self, ordering: Ordering, *, max_depth: int,
                 class_depths: Mapping[str, int] | None = None) -> None:
        self._ordering = ordering
        self.max_depth = max_depth
        self._class_depths = dict(class_depths or {})
        self._waiters: list[Waiter] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._waiters)

    def __iter__(self) -> Iterator[Waiter]:
        return iter(self._waiters)

    def __contains__(self, waiter: object) -> bool:
        return waiter in self._waiters

    def add(self, waiter: Waiter) -> None:
        self._waiters.append(waiter)

    def remove(self, waiter: Waiter) -> None:
        self._waiters.remove(waiter)

    def next_view(self, demand: Demand, arrival: float) -> WaiterView:
        """`demand`'s place in the order, arriving now: behind every earlier arrival
        among its equals (admissions without queueing take a number too)."""
        return WaiterView(seq=next(self._seq), arrival=arrival, demand_tokens=demand.tokens,
                          priority=demand.priority, tenant=demand.tenant,
                          held_place=demand.held_place)

    @property
    def full(self) -> bool:
        return len(self._waiters) >= self.max_depth

    def class_full(self, priority: str) -> int | None:
        """The bound of `priority`'s class where that many of it wait already, else None."""
        depth = self._class_depths.get(priority)
        if depth is None:
            return None
        waiting = sum(1 for w in self._waiters if w.demand.priority == priority)
        return depth if waiting >= depth else None

    def victim_for(self, priority: str) -> Waiter | None:
        """Who a newcomer of `priority` replaces in a full room: the newest waiter of
        the lowest class below it; None where nobody waits below it."""
        rank = class_rank(priority)
        lower = [w for w in self._waiters
                 if class_rank(w.demand.priority) > rank and not w.fut.done()]
        if not lower:
            return None
        return max(lower, key=lambda w: (class_rank(w.demand.priority), w.view.seq))

    def in_order(self, now: float) -> list[Waiter]:
        """Every waiter, in the order room is offered to them now."""
        return sorted(self._waiters, key=lambda w: self._ordering.key(w.view, now))

    def ahead_of(self, demand: Demand, arrival: float) -> list[Waiter]:
        """The live waiters the order puts ahead of `demand` arriving now (behind its
        equals), in that order."""
        key = self._ordering.key
        mine = key(WaiterView(seq=1 << 62, arrival=arrival, demand_tokens=demand.tokens,
                              priority=demand.priority, tenant=demand.tenant,
                              held_place=demand.held_place), arrival)
        return sorted((w for w in self._waiters
                       if not w.fut.done() and key(w.view, arrival) < mine),
                      key=lambda w: key(w.view, arrival))

    def oldest_wait_s(self, now: float) -> float:
        return max((now - w.view.arrival for w in self._waiters), default=0.0)

    def queued_tokens(self) -> int:
        return sum(w.demand.tokens for w in self._waiters)
