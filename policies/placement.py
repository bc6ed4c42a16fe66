"""Placement: which backend with room takes a request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["BackendRoom", "PlacementName", "rank_backends"]


class PlacementName(StrEnum):
    BEST_FIT = "best-fit"  # least free room that still fits: keeps big holes for big requests
    LEAST_RESIDENT = "least-resident"  # spread load evenly


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendRoom:
    name: str
    capacity_tokens: int
    resident_tokens: int

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.resident_tokens


def rank_backends(
    backends: Sequence[BackendRoom], demand_tokens: int, policy: PlacementName
) -> list[str]:
    """Backends that fit `demand_tokens` now, best first; ties keep config order."""
    fitting = [b for b in backends if b.free_tokens >= demand_tokens]
    if policy is PlacementName.BEST_FIT:
        fitting.sort(key=lambda b: b.free_tokens - demand_tokens)
    else:
        fitting.sort(key=lambda b: b.resident_tokens / max(1, b.capacity_tokens))
    return [b.name for b in fitting]
