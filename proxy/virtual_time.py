"""An asyncio loop whose clock jumps to the next timer, for `kvgate simulate`.

Why a virtual-time event loop rather than a second, pure engine step: the gate,
the controller, the tracker and the engine are asyncio code whose behaviour
depends on the order in which futures resolve and timers fire. A copy of that
logic as pure functions would drift from what production runs; a loop whose clock
jumps to the next timer when nothing is ready runs the unchanged code, in the same
order, without sleeping.
"""

from __future__ import annotations

import asyncio
import selectors

__all__ = ["VirtualClockLoop"]


class _JumpSelector(selectors.SelectSelector):
    """Asked to wait, move the virtual clock instead and report nothing ready."""

    def __init__(self, clock: list[float]) -> None:
        super().__init__()
        self._clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise RuntimeError("virtual-time loop: nothing scheduled and nothing ready "
                               "(every task waits on a future nobody resolves)")
        if timeout > 0:
            self._clock[0] += timeout
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An asyncio loop whose clock jumps to the next timer: an hour runs in seconds.

    Only for code that does no I/O: a socket registered here would never be
    reported ready.
    """

    def __init__(self) -> None:
        self._vclock = [0.0]
        super().__init__(selector=_JumpSelector(self._vclock))

    def time(self) -> float:
        return self._vclock[0]
