"""The recent release rate of a model's backends: what deadline predictions and
`Retry-After` are computed from."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

__all__ = ["ReleaseRate"]

# The shortest span the passing rate is read over. Arrivals at one instant are no
# rate: 200 streams sent at once behind a llama-server's 4 slots, read over 1 s,
# refused 64 of them that got in in time; over 5 s, none (and 1 s against 5 s on the
# replays below: goodput 453 -> 458, refusals within 50 ms about the same).
_PASSING_MIN_SPAN_S = 5.0


# The cold-start prior (`ReleaseRate.cold_start_tokens_per_s`): it is known once a
# live lease has run this long, and a younger lease counts as this old (one just
# granted has told nothing of how long it runs); the share of `tokens / age` a lease
# is taken to free per second.
_PRIOR_MIN_AGE_S = 1.0
_PRIOR_SHARE = 0.25


class HeldLease(Protocol):
    """What the prior reads of a live lease (`proxy.leases.Lease`)."""

    @property
    def lease_id(self) -> str: ...
    @property
    def tokens(self) -> int: ...
    @property
    def shared_tokens(self) -> int: ...


def _loop_time() -> float:
    """The running loop's clock (virtual in `kvgate simulate`), else the monotonic one."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


class ReleaseRate:
    """Tokens released per second over a sliding window.

    Two rates. `busy_tokens_per_s` counts only releases made while requests were
    waiting, over only the time they were waiting: then every release is bounded by the
    pool, not by how much traffic came, so it is the rate a queue drains at. It is what
    admission by deadline refuses on, and it stays unknown until `min_busy_releases`
    releases have been seen, because a rate read from one or two releases is mostly
    noise. Dividing by the whole window instead (or by a floor of one second, as an
    earlier version did) under-reads the rate at the start of a burst: 200 streams
    queued behind four slots that each free 930 tokens every few milliseconds read as
    930 tokens/s after the first release, and every waiter was refused as late while
    the whole queue drained in under a second.

    A release counts what it frees in the ledger's terms: its lease's tokens less the
    shared blocks other leases held when it was reserved (`Lease.shared_tokens`), so
    that over a run the releases free what the reservations charged, each shared block
    once: the units the waits are predicted in (`PrefixView.least_cost`). Counted
    whole, a group's requests sharing a 2,048-token system prompt read a drain rate
    that was mostly their shared blocks, and waiters let in on it started past the
    SLO (G, one run each: 55 of 324 completions after 3 s where 0 of 263 were before).

    Until the busy rate is known (a cold start, or a quiet half-minute), a newcomer is
    judged at arrival on what the live leases promise instead
    (`cold_start_tokens_per_s`, `arrival_tokens_per_s`); waiters are not.

    `tokens_per_s` is the busy rate when known and else the rate over the window; it
    only sizes `Retry-After`, where a cautious guess costs a client one retry.

    `passing_tokens_per_s(tokens)` is the rate, over the whole window, at which requests
    smaller than `tokens` joined the queue (`queued`): dispatch lets a smaller waiter
    take room a larger one ahead of it cannot use yet, so that is the share of the
    drain a newcomer of `tokens` should expect later arrivals to take before it
    (`proxy.deadlines.passed_wait_s`). Over the whole window rather than the busy
    time: arrivals come in bursts, and the burst that made the queue is not the rate
    that follows it (over the busy time, 15 more of the 2,867 requests of an
    under-capacity replay were refused). Until a whole window has been seen (a cold
    start), over the time seen instead (5 s at least): over 30 s, a burst's first
    seconds read a fraction of what passed, and the large newcomers it let in were
    refused after waiting. `kvgate simulate`, from a cold start, 2 x 16,384 tokens,
    3 s deadline: four 34 s windows of the Azure conversation trace at 2x, refusals
    within 50 ms 57-67% -> 73-87%, goodput 465 -> 458; three 20 s draws of the
    benchmarks' bursty long-prompt scenario, 67-88% -> 80-95%, goodput 271 -> 273.
    """

    def __init__(self, window_s: float = 30.0, clock: Callable[[], float] | None = None,
                 *, min_busy_releases: int = 4) -> None:
        self._window_s = window_s
        self._clock = clock or _loop_time
        self._min_busy = min_busy_releases
        self._events: deque[tuple[float, int, bool]] = deque()  # (when, tokens, busy)
        self._sum = 0
        self._busy_sum = 0
        self._busy_count = 0
        self._busy_since: float | None = None
        self._spans: deque[tuple[float, float]] = deque()  # closed busy spans
        self._spans_s = 0.0
        self._queued: deque[tuple[float, int]] = deque()  # (when, tokens) joined the queue
        self._first_queued: float | None = None
        self._live: dict[str, tuple[HeldLease, float]] = {}  # lease id -> (lease, granted)

    def set_busy(self, busy: bool) -> None:
        """Whether requests are waiting now; call on every change."""
        now = self._clock()
        if busy and self._busy_since is None:
            self._busy_since = now
        elif not busy and self._busy_since is not None:
            self._spans.append((self._busy_since, now))
            self._spans_s += now - self._busy_since
            self._busy_since = None
        self._trim(now)

    def started(self, lease: HeldLease) -> None:
        """A lease was granted: the cold-start prior counts it until it is released."""
        self._live[lease.lease_id] = (lease, self._clock())

    def released(self, lease: HeldLease) -> None:
        """A lease ended: it frees what it was charged (`record`)."""
        self._live.pop(lease.lease_id, None)
        self.record(lease.tokens - lease.shared_tokens)

    def record(self, tokens: int) -> None:
        now = self._clock()
        busy = self._busy_since is not None
        self._events.append((now, tokens, busy))
        self._sum += tokens
        if busy:
            self._busy_sum += tokens
            self._busy_count += 1
        self._trim(now)

    def _trim(self, now: float) -> None:
        start = now - self._window_s
        while self._events and self._events[0][0] < start:
            _, tokens, busy = self._events.popleft()
            self._sum -= tokens
            if busy:
                self._busy_sum -= tokens
                self._busy_count -= 1
        while self._spans and self._spans[0][1] < start:
            begin, end = self._spans.popleft()
            self._spans_s -= end - begin
        while self._queued and self._queued[0][0] < start:
            self._queued.popleft()

    def queued(self, tokens: int) -> None:
        """A request of `tokens` joined the queue (predicted to start in time)."""
        now = self._clock()
        if self._first_queued is None:
            self._first_queued = now
        self._queued.append((now, tokens))
        self._trim(now)

    def passing_tokens_per_s(self, tokens: int) -> float:
        """Tokens per second of requests smaller than `tokens` that joined the queue
        within the window: the room later arrivals take past a waiter of `tokens`."""
        now = self._clock()
        self._trim(now)
        if self._first_queued is None:
            return 0.0
        # over the time seen while it is shorter than the window (a cold start)
        span = max(_PASSING_MIN_SPAN_S, min(self._window_s, now - self._first_queued))
        return sum(t for _, t in self._queued if t < tokens) / span

    def _busy_s(self, now: float) -> float:
        """Seconds within the window during which requests were waiting."""
        start = now - self._window_s
        total = self._spans_s
        if self._spans and self._spans[0][0] < start:  # only the oldest can straddle it
            total -= start - self._spans[0][0]
        if self._busy_since is not None:
            total += now - max(start, self._busy_since)
        return max(0.0, total)

    def busy_tokens_per_s(self) -> float | None:
        """The rate a queue drains at, or None while too few releases back it."""
        now = self._clock()
        self._trim(now)
        busy_s = self._busy_s(now)
        if self._busy_count < self._min_busy or busy_s <= 0:
            return None
        return self._busy_sum / busy_s

    def cold_start_tokens_per_s(self) -> float | None:
        """What the live leases should free per second, before any rate is measured;
        None until one of them has run `_PRIOR_MIN_AGE_S`. Each frees its charged
        tokens at a quarter of `tokens / age` (`_PRIOR_SHARE`): taken to run as long
        again as it has run, the rule that sizes an adaptive lease at a cold start,
        `tokens / age` over-read the measured busy rate by 2.6x (bursty long prompts)
        and 3.3x (Azure conversation) at the median, 1.8x-2.0x at the 10th percentile,
        in `kvgate simulate` once both were known.

        Nothing before a lease has run a second: a burst at a cold start on answers
        that end in a fraction of that would be judged on a rate several times too low.
        600 requests in 0.6 s on 2 x 16,384 tokens, 10-token answers, 3 s deadline:
        without that wait the prior refused 496 at once and 104 completed, against 462
        and 138 with it, as without a prior."""
        if not self._live:
            return None
        now = self._clock()
        _, oldest = next(iter(self._live.values()))  # granted in this order
        if now - oldest < _PRIOR_MIN_AGE_S:
            return None
        return _PRIOR_SHARE * sum(
            (lease.tokens - lease.shared_tokens) / max(_PRIOR_MIN_AGE_S, now - granted)
            for lease, granted in self._live.values())

    def arrival_tokens_per_s(self) -> float | None:
        """The drain rate a newcomer is judged on at arrival: the busy rate, and until
        that is known the cold-start prior (a waiter is judged at dispatch passes on the
        busy rate alone, so the prior never refuses one that waited). Without it,
        every request that queued in a run's first seconds (four releases while
        requests wait take ~6 s at 2x on the Azure conversation lengths) waited to be
        refused: half the late refusals of those runs. `kvgate simulate`, from a cold
        start, 2 x 16,384 tokens, 3 s deadline, `cap-2048` clients: sixteen 20 s
        windows of the Azure conversation trace at 2x, refusals within 50 ms 83.1% ->
        87.5%, goodput 1,639 -> 1,645 (`none` clients: 82.9% -> 87.3%, 1,641 -> 1,648);
        at 1x, 64.3% -> 76.7%, 1,188 -> 1,184; at 0.5x, 644 either way; sixteen draws
        of the bursty long-prompt scenario, 87.0% -> 95.9%, 1,433 -> 1,434."""
        rate = self.busy_tokens_per_s()
        return rate if rate is not None else self.cold_start_tokens_per_s()

    def tokens_per_s(self) -> float:
        busy = self.busy_tokens_per_s()
        if busy is not None:
            return busy
        now = self._clock()
        if not self._events:
            return 0.0
        span = max(1.0, now - self._events[0][0])
        return self._sum / span

    def wait_s(self, tokens_ahead: int, *, floor_s: float = 1.0, ceiling_s: float = 60.0) -> float:
        """Seconds until `tokens_ahead` should have been released at the recent rate."""
        rate = self.tokens_per_s()
        if rate <= 0:
            return floor_s
        return min(ceiling_s, max(floor_s, tokens_ahead / rate))
