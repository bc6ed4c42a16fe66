"""Queue ordering: who is offered capacity first. Pure: `now` is always an argument.

Each policy turns a waiter into a sort key at `now`; the queue re-sorts on each
dispatch, so keys never drift inside a heap (vLLM's WeightedScoreSorter bug). A waiter
holding a place (a refused request back with its ticket) comes first within its class.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

__all__ = [
    "AGING_TOKENS_PER_S",
    "FAIR_SHARE_HALF_LIFE_S",
    "ORDERINGS",
    "PRIORITY_CLASSES",
    "Fifo",
    "Ordering",
    "OrderingName",
    "PriorityFairShare",
    "ShortestFirst",
    "WaiterView",
    "class_rank",
    "make_ordering",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class WaiterView:
    """What an ordering may know about a waiter."""

    seq: int  # arrival order
    arrival: float  # loop time
    demand_tokens: int
    priority: str  # class name, "" when none
    tenant: str  # fair-share key, "" when none
    # it brought a ticket (`proxy.tickets`): refused before, it came back when told to,
    # and goes ahead of every waiter of its class that holds none
    held_place: bool = False


class Ordering(Protocol):
    def key(self, waiter: WaiterView, now: float) -> tuple[float, ...]:
        """Smaller keys are offered capacity first."""
        ...

    def on_admit(self, waiter: WaiterView, now: float) -> None:
        """Account an admission at `now`, queued or not (fair-share policies keep usage)."""
        ...


PRIORITY_CLASSES = ("high", "normal", "low")

def class_rank(priority: str, classes: tuple[str, ...] = PRIORITY_CLASSES) -> int:
    """0 for the highest class; a priority outside the classes ranks below them all."""
    try:
        return classes.index(priority)
    except ValueError:
        return len(classes)


# The defaults, here once: the policies', `make_ordering`'s and `[queue]`'s
# (`proxy.config.QueueConfig.aging_tokens_per_s`, `.fair_share_half_life_s`).
AGING_TOKENS_PER_S = 4000.0
FAIR_SHARE_HALF_LIFE_S = 60.0


class OrderingName(StrEnum):
    FIFO = "fifo"
    SHORTEST_FIRST = "shortest-first"
    PRIORITY = "priority"


class Fifo:
    """Arrival order (those holding a place first)."""

    def key(self, waiter: WaiterView, now: float) -> tuple[float, ...]:
        return (not waiter.held_place, waiter.seq)

    def on_admit(self, waiter: WaiterView, now: float) -> None:
        return None


@dataclass(slots=True, kw_only=True)
class ShortestFirst:
    """Smallest demand first, with aging so long requests are not starved.

    Key = demand_tokens - aging_tokens_per_s * waited_s: a 30,000-token request
    that has waited 10 s at 4,000 tokens/s ranks like a -10,000-token one, ahead
    of any newcomer.
    """

    aging_tokens_per_s: float = AGING_TOKENS_PER_S

    def key(self, waiter: WaiterView, now: float) -> tuple[float, ...]:
        waited = max(0.0, now - waiter.arrival)
        return (not waiter.held_place,
                waiter.demand_tokens - self.aging_tokens_per_s * waited, waiter.seq)

    def on_admit(self, waiter: WaiterView, now: float) -> None:
        return None


class PriorityFairShare:
    """Priority classes first; within a class, the tenant with least weighted usage.

    Usage is admitted tokens divided by the tenant's weight (default 1), so a
    tenant of weight 2 gets about twice the tokens of a tenant of weight 1 when
    both keep the queue busy. Every admission is charged, queued or not: a tenant
    whose requests pass straight through still used the capacity. Usage decays
    exponentially with `half_life_s`, so what a tenant did an hour ago does not
    rank it now: 1,000 tokens charged at t=0 count 500 at t=60 s (half-life 60 s).

    A tenant not seen before (or forgotten) starts at the least usage of the known
    tenants, not at zero: inventing a new tenant name per request ties with the
    lightest tenant and never jumps ahead of it. Classes are ranked by `classes`
    (first = highest); unknown or missing classes rank last.
    """

    def __init__(
        self,
        *,
        classes: tuple[str, ...] = PRIORITY_CLASSES,
        weights: Mapping[str, float] | None = None,
        half_life_s: float = FAIR_SHARE_HALF_LIFE_S,
        max_tenants: int = 4096,
    ) -> None:
        if half_life_s <= 0:
            raise ValueError(f"`half_life_s` must be > 0. Given: {half_life_s}")
        self.classes = classes
        self.weights = dict(weights or {})
        self.half_life_s = half_life_s
        self.max_tenants = max_tenants
        self._usage: dict[str, tuple[float, float]] = {}  # tenant -> (usage, charged at)
        self._floor: tuple[float, float] | None = None  # (now, least usage at now)

    def _rank(self, priority: str) -> int:
        return class_rank(priority, self.classes)

    def _weight(self, tenant: str) -> float:
        return max(1e-9, self.weights.get(tenant, 1.0))

    def _decayed(self, entry: tuple[float, float], now: float) -> float:
        usage, at = entry
        return usage * math.pow(0.5, max(0.0, now - at) / self.half_life_s)

    def _least(self, now: float) -> float:
        """Least usage among known tenants at `now` (0 when none), cached per `now`."""
        if self._floor is None or self._floor[0] != now:
            least = min((self._decayed(e, now) for e in self._usage.values()), default=0.0)
            self._floor = (now, least)
        return self._floor[1]

    def usage(self, tenant: str, now: float) -> float:
        """Weighted, decayed usage at `now`; a new tenant's is the current least."""
        entry = self._usage.get(tenant)
        return self._decayed(entry, now) if entry is not None else self._least(now)

    def key(self, waiter: WaiterView, now: float) -> tuple[float, ...]:
        return (self._rank(waiter.priority), not waiter.held_place,
                self.usage(waiter.tenant, now), waiter.seq)

    def on_admit(self, waiter: WaiterView, now: float) -> None:
        share = waiter.demand_tokens / self._weight(waiter.tenant)
        self._usage[waiter.tenant] = (self.usage(waiter.tenant, now) + share, now)
        self._floor = None
        if len(self._usage) > self.max_tenants:
            self._forget(now)

    def _forget(self, now: float) -> None:
        """Keep the map bounded: drop the lightest half. A dropped tenant comes back
        at the least usage of those kept, at most what it would have had plus that
        least; name churn cannot grow memory."""
        by_usage = sorted(self._usage, key=lambda t: self._decayed(self._usage[t], now))
        for tenant in by_usage[: len(by_usage) // 2]:
            del self._usage[tenant]
        self._floor = None


ORDERINGS = {name.value for name in OrderingName}


def make_ordering(
    name: str,
    *,
    weights: Mapping[str, float] | None = None,
    aging_tokens_per_s: float = AGING_TOKENS_PER_S,
    half_life_s: float = FAIR_SHARE_HALF_LIFE_S,
) -> Ordering:
    if name == OrderingName.FIFO:
        return Fifo()
    if name == OrderingName.SHORTEST_FIRST:
        return ShortestFirst(aging_tokens_per_s=aging_tokens_per_s)
    if name == OrderingName.PRIORITY:
        return PriorityFairShare(weights=weights, half_life_s=half_life_s)
    raise ValueError(f"unknown ordering {name!r}; expected one of {sorted(ORDERINGS)}")
