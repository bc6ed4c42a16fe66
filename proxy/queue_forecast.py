"""What the release rate says about a model's queue: when each waiter could start, and
the refusal of one that cannot start by its deadline.

The glue between `proxy.release_rate` (how fast the pool frees tokens while requests
wait) and `proxy.deadlines` (the arithmetic), for the admission controller, which
refuses a newcomer at arrival and a waiter at each dispatch pass on it.

Admission by deadline, measured with `kvgate simulate` on the Azure conversation
slice (2 x 16,384 tokens, 3 s deadline, speed 4 and 8): goodput 948 -> 1,012 and
602 -> 739 against refusing only at the deadline. Refusing on the predicted wait x 1.5
(or 2) refused requests that would have made it: 788 (775).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from policies.placement import BackendRoom
from proxy.deadlines import passed_wait_s, predict_waits
from proxy.errors import QueueTimeout
from proxy.release_rate import ReleaseRate

__all__ = ["forecast", "predicted_late"]


def forecast(rate: ReleaseRate, rooms: Callable[[], Sequence[BackendRoom]],
             queue: Iterable[tuple[int, float]], now: float,
             newcomer: tuple[int, float] | None = None, *,
             nobody_passes_after_s: float = math.inf) -> list[tuple[float, bool]] | None:
    """`predict_waits` over `queue` ((tokens, deadline) in queue order) and `newcomer`
    behind it, whose wait is stretched by the smaller arrivals that will pass it until
    it starves (`passed_wait_s`); None while the queue's drain rate is unknown.
    `rooms` (every healthy backend's room, for the newcomer's demand where there is
    one) and `queue` are read only when the rate is known: they cost a look at every
    backend. The newcomer waits for what it adds where that is least
    (`BackendRoom.cost`: its prefix held ready there is not charged), as the waiters'
    tokens in `queue` are (`PrefixView.least_cost`)."""
    busy = rate.busy_tokens_per_s() if newcomer is None else rate.arrival_tokens_per_s()
    if busy is None or busy <= 0:
        return None
    room = rooms()
    waits = list(queue)
    if newcomer is not None:
        tokens, deadline = newcomer
        waits.append((min((r.cost(tokens) for r in room), default=tokens), deadline))
    predicted = predict_waits(busy, sum(max(0, r.free_tokens) for r in room), waits, now)
    if newcomer is not None:
        wait_s = passed_wait_s(predicted[-1][0], busy, rate.passing_tokens_per_s(waits[-1][0]),
                               nobody_passes_after_s=nobody_passes_after_s)
        predicted[-1] = (wait_s, now + wait_s <= deadline)
    return predicted


def predicted_late(model: str, tokens: int, wait_s: float, left_s: float) -> QueueTimeout:
    """The refusal of a request predicted to wait `wait_s` with `left_s` to its
    deadline: Retry-After is that wait (1 to 60 s, as `ReleaseRate.wait_s` bounds it)."""
    wait = "ever" if math.isinf(wait_s) else f"{wait_s * 1000:.0f} ms more"
    return QueueTimeout(
        f"no capacity for model {model!r} within the deadline: predicted to wait "
        f"{wait} for {tokens} tokens with {max(0.0, left_s) * 1000:.0f} ms left; "
        "refused before it",
        retry_after_s=min(60.0, max(1.0, wait_s)), predicted=True)
