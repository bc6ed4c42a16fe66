"""Placement: which backend with room takes a request.

Where a request's prefix already lives. A backend whose live leases hold some of
the request's leading blocks (ready: their engine has answered) charges it less, and
its engine computes less (a prefix hit); one where they were released recently
probably still caches them (`proxy.recent_blocks`): no smaller charge, the same hit.
Among the backends with room, the one that would hold most of the prefix goes
first, *sticky until saturated*, as llm-d's precise prefix routing and SGLang's
cache-aware router do: it stays first while its fill after the placement is at most
`PREFIX_IMBALANCE` above the least filled backend's that fits; past that the request
goes where the load is (and, once answered there, seeds the prefix there too), so a
hot prefix does not pile onto one backend while others idle. SGLang switches to load
on an absolute gap of 32 running requests; a share of the pool is the same idea in
the unit kvgate admits in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["PREFIX_IMBALANCE", "BackendRoom", "PlacementName", "rank_backends"]

# fill (resident / admission room) a prefix-holding backend may run ahead of the least
# filled backend that fits and still be preferred
PREFIX_IMBALANCE = 0.25


class PlacementName(StrEnum):
    BEST_FIT = "best-fit"  # least free room that still fits: keeps big holes for big requests
    LEAST_RESIDENT = "least-resident"  # spread load evenly


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendRoom:
    name: str
    capacity_tokens: int
    resident_tokens: int
    shared_tokens: int = 0  # of the demand, held there in ready shared blocks: not charged
    cached_tokens: int = 0  # more of its prefix, probably still in the engine's cache there

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.resident_tokens

    @property
    def prefix_tokens(self) -> int:
        """Of the demand's prefix, what the engine there would not compute again."""
        return self.shared_tokens + self.cached_tokens

    def cost(self, demand_tokens: int) -> int:
        """What the demand adds here."""
        return demand_tokens - self.shared_tokens

    def fill_after(self, demand_tokens: int) -> float:
        return (self.resident_tokens + self.cost(demand_tokens)) / max(1, self.capacity_tokens)


def rank_backends(
    backends: Sequence[BackendRoom], demand_tokens: int, policy: PlacementName
) -> list[str]:
    """Backends that fit `demand_tokens` now (less what each shares), best first; ties
    keep config order."""
    fitting = [b for b in backends if b.free_tokens >= b.cost(demand_tokens)]
    if policy is PlacementName.BEST_FIT:
        fitting.sort(key=lambda b: b.free_tokens - b.cost(demand_tokens))
    else:
        fitting.sort(key=lambda b: b.resident_tokens / max(1, b.capacity_tokens))
    if fitting and max(b.prefix_tokens for b in fitting) > 0:
        least = min(b.fill_after(demand_tokens) for b in fitting)
        sticky = [b for b in fitting
                  if b.prefix_tokens > 0
                  and b.fill_after(demand_tokens) <= least + PREFIX_IMBALANCE]
        sticky.sort(key=lambda b: -b.prefix_tokens)  # stable: the policy's order on ties
        rest = [b for b in fitting if b not in sticky]
        fitting = sticky + rest
    return [b.name for b in fitting]
