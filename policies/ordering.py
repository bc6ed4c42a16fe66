"""Queue ordering: who is offered capacity first. Pure: `now` is always an argument.

Each policy turns a waiter into a sort key at `now`; the queue re-sorts on each
dispatch, so keys never drift inside a heap (vLLM's WeightedScoreSorter bug).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

__all__ = [
    "ORDERINGS",
    "PRIORITY_CLASSES",
    "Fifo",
    "Ordering",
    "OrderingName",
    "PriorityFairShare",
    "ShortestFirst",
    "WaiterView",
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


class Ordering(Protocol):
    def key(self, waiter: WaiterView, now: float) -> tuple[float, ...]:
        """Smaller keys are offered capacity first."""
        ...

    def on_admit(self, waiter: WaiterView) -> None:
        """Account an admission (fair-share policies keep usage)."""
        ...


PRIORITY_CLASSES = ("high", "normal", "low")


class OrderingName(StrEnum):
    FIFO = "fifo"
    SHORTEST_FIRST = "shortest-first"
    PRIORITY = "priority"


class Fifo:
    """Arrival order."""

    def key(self, waiter: WaiterView, now: float) -> tuple[float, ...]:
        return (waiter.seq,)

    def on_admit(self, waiter: WaiterView) -> None:
        return None


@dataclass(slots=True, kw_only=True)
class ShortestFirst:
    """Smallest demand first, with aging so long requests are not starved.

    Key = demand_tokens - aging_tokens_per_s * waited_s: a 30,000-token request
    that has waited 10 s at 4,000 tokens/s ranks like a -10,000-token one, ahead
    of any newcomer.
    """

    aging_tokens_per_s: float = 4000.0

    def key(self, waiter: WaiterView, now: float) -> tuple[float, ...]:
        waited = max(0.0, now - waiter.arrival)
        return (waiter.demand_tokens - self.aging_tokens_per_s * waited, waiter.seq)

    def on_admit(self, waiter: WaiterView) -> None:
        return None


@dataclass(slots=True, kw_only=True)
class PriorityFairShare:
    """Priority classes first; within a class, the tenant with least weighted usage.

    Usage is admitted tokens divided by the tenant's weight (default 1), so a
    tenant of weight 2 gets about twice the tokens of a tenant of weight 1 when
    both keep the queue busy. Classes are ranked by `classes` (first = highest);
    unknown or missing classes rank last.
    """

    classes: tuple[str, ...] = PRIORITY_CLASSES
    weights: Mapping[str, float] | None = None
    _usage: dict[str, float] | None = None

    def _rank(self, priority: str) -> int:
        try:
            return self.classes.index(priority)
        except ValueError:
            return len(self.classes)

    def _weight(self, tenant: str) -> float:
        return max(1e-9, (self.weights or {}).get(tenant, 1.0))

    def key(self, waiter: WaiterView, now: float) -> tuple[float, ...]:
        usage = (self._usage or {}).get(waiter.tenant, 0.0)
        return (self._rank(waiter.priority), usage, waiter.seq)

    def on_admit(self, waiter: WaiterView) -> None:
        if self._usage is None:
            self._usage = {}
        share = waiter.demand_tokens / self._weight(waiter.tenant)
        self._usage[waiter.tenant] = self._usage.get(waiter.tenant, 0.0) + share


ORDERINGS = {name.value for name in OrderingName}


def make_ordering(
    name: str, *, weights: Mapping[str, float] | None = None, aging_tokens_per_s: float = 4000.0
) -> Ordering:
    if name == OrderingName.FIFO:
        return Fifo()
    if name == OrderingName.SHORTEST_FIRST:
        return ShortestFirst(aging_tokens_per_s=aging_tokens_per_s)
    if name == OrderingName.PRIORITY:
        return PriorityFairShare(weights=weights)
    raise ValueError(f"unknown ordering {name!r}; expected one of {sorted(ORDERINGS)}")
