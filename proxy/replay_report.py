"""What one `kvgate simulate` replay measured (`proxy.replay`), and its `--json` form."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["SimReport", "quantile"]


def quantile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank quantile; None when there is nothing to rank."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass(slots=True, kw_only=True)
class SimReport:
    """What one replay measured; `as_dict` is the `--json` output."""

    label: str
    backends: int
    capacity_tokens: int
    reservation: str
    client: str
    requests: int
    completed: int
    rejected: dict[str, int]
    trace_span_s: float
    virtual_s: float
    # the three production numbers
    peak_concurrent: dict[str, int]
    resident_per_request: dict[str, float | None]
    min_headroom_tokens: int
    min_headroom_at_s: float
    min_headroom_backend: str
    # KV use over time (the engines' blocks in use, 0..1 of each pool, all backends)
    kv_use: dict[str, float]
    ledger_use: dict[str, float]
    queue_wait_s: dict[str, float | None]
    rejection_latency_s: dict[str, float | None]  # arrival to the 429, 503 or 413
    ttft_s: dict[str, float | None]
    preemptions: int
    ttft_slo_s: float
    goodput: int
    goodput_ratio: float
    # prefix sharing: tokens admitted requests were not charged (blocks already held
    # there), and the engines' own prefix-cache hits and queries (tokens)
    shared_prefix_tokens: int = 0
    engine_prefix_hit_tokens: int = 0
    engine_prefix_query_tokens: int = 0
    # retries (`Scenario.retries`): sent after a refusal's Retry-After, and of those the
    # ones admitted on that try (not refused again); `rejected` counts each request once,
    # by its last answer
    retries: int = 0
    retries_admitted: int = 0
    timeline: list[dict[str, float]] = field(default_factory=list)

    @property
    def retry_success_ratio(self) -> float | None:
        return self.retries_admitted / self.retries if self.retries else None

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

    @property
    def rejected_ratio(self) -> float:
        return self.rejected_total / self.requests if self.requests else 0.0

    def as_dict(self, *, timeline: bool = False) -> dict[str, Any]:
        out = asdict(self)
        out["rejected_total"] = self.rejected_total
        out["rejected_ratio"] = round(self.rejected_ratio, 6)
        ratio = self.retry_success_ratio
        out["retry_success_ratio"] = None if ratio is None else round(ratio, 6)
        if not timeline:
            out.pop("timeline")
        return out
