"""A budget of the bytes that request bodies hold before admission, per model and in total.

A body up to `server.body_limit` is read into memory, and kept while its prompt is
counted and while it waits in the admission queue: many clients sending large bodies,
or holding uploads open, could pin gigabytes. So each body charges its bytes here from
its first byte (all its declared `Content-Length` at once) until it is admitted or
answered. A body that would take the total past `server.body_budget`, or its model's
bytes past `server.body_budget_per_model`, is refused at once (`503 memory_budget`,
retryable: the budget holds at least one body of the largest size, so a retry can pass)
and holds nothing else. After admission a body is bounded by what admission bounds (the
backends' capacity), so it no longer counts here.

Plain bookkeeping on the event loop, no I/O: `proxy.server` charges and releases,
`proxy.admin` and `proxy.metrics` read the figures.
"""

from __future__ import annotations

from collections.abc import Iterable

from proxy.errors import MemoryBudgetFull

__all__ = ["BodyBudget", "BodyHold"]

TOTAL = "total"  # the budget a refusal came from: all bodies, or its model's share
MODEL = "model"


class BodyBudget:
    """Bytes held by bodies not yet admitted: in total, and per served model."""

    def __init__(self, total_bytes: int, per_model_bytes: int, models: Iterable[str]) -> None:
        self.total_bytes = total_bytes
        self.per_model_bytes = per_model_bytes
        self.held = 0
        self.held_by_model: dict[str, int] = dict.fromkeys(models, 0)
        # (budget, model) -> refusals; model "" where it was not known yet (still reading)
        self.refusals: dict[tuple[str, str], int] = {}

    def hold(self) -> BodyHold:
        """An empty hold for one request's body; released on every way out."""
        return BodyHold(self)

    def refused(self, budget: str, model: str, wanted: int) -> MemoryBudgetFull:
        """Count a refusal by `budget` (TOTAL or MODEL) and make its answer."""
        key = (budget, model)
        self.refusals[key] = self.refusals.get(key, 0) + 1
        if budget == TOTAL:
            where = f"the {self.total_bytes} bytes kvgate holds for request bodies"
            held = self.held
        else:
            where = f"the {self.per_model_bytes} bytes it holds for bodies of model {model!r}"
            held = self.held_by_model[model]
        return MemoryBudgetFull(
            f"this request's body of {wanted} bytes does not fit {where} waiting for "
            f"admission ({held} held now); retry later", param="body", retry_after_s=1.0)


class BodyHold:
    """One request's bytes in a `BodyBudget`: grown as the body arrives, charged to its
    model once known, and given back exactly once by `release`."""

    __slots__ = ("_budget", "_model", "bytes")

    def __init__(self, budget: BodyBudget) -> None:
        self._budget = budget
        self._model: str | None = None
        self.bytes = 0

    def grow_to(self, size: int) -> None:
        """Hold `size` bytes in all (never fewer than held); refused past the total."""
        more = size - self.bytes
        if more <= 0:
            return
        budget = self._budget
        if budget.held + more > budget.total_bytes:
            raise budget.refused(TOTAL, self._model or "", size)
        budget.held += more
        self.bytes = size
        if self._model is not None:
            budget.held_by_model[self._model] += more

    def assign(self, model: str) -> None:
        """Charge the bytes held to `model` (a served model); refused past its share."""
        assert self._model is None, "a body belongs to one model"
        budget = self._budget
        if budget.held_by_model[model] + self.bytes > budget.per_model_bytes:
            raise budget.refused(MODEL, model, self.bytes)
        budget.held_by_model[model] += self.bytes
        self._model = model

    def release(self) -> None:
        """Give every byte back; a second call does nothing."""
        budget = self._budget
        budget.held -= self.bytes
        if self._model is not None:
            budget.held_by_model[self._model] -= self.bytes
        self.bytes = 0
