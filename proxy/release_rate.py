"""The recent release rate of a model's backends: what `Retry-After` is computed from."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

__all__ = ["ReleaseRate"]


def _loop_time() -> float:
    """The running loop's clock (virtual in `kvgate simulate`), else the monotonic one."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


class ReleaseRate:
    """Tokens released per second over a sliding window: the basis of Retry-After."""

    def __init__(self, window_s: float = 30.0, clock: Callable[[], float] | None = None):
        self._window_s = window_s
        self._clock = clock or _loop_time
        self._events: deque[tuple[float, int]] = deque()
        self._sum = 0

    def record(self, tokens: int) -> None:
        now = self._clock()
        self._events.append((now, tokens))
        self._sum += tokens
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self._window_s:
            self._sum -= self._events.popleft()[1]

    def tokens_per_s(self) -> float:
        now = self._clock()
        self._trim(now)
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
