"""The lane of large bodies: a bounded share of the process's CPU, taken by turns.

Parsing, checking, rendering and counting a request are CPU work in this process, and
most of it holds the GIL (C code, or Python in 5 ms slices): while it runs, the event
loop, and with it every other client's small requests, waits. One client sending
4 MB bodies as fast as kvgate answers kept busy a thread that way all the time, and
small chats beside it lost up to four fifths of their throughput.

So the work of a request whose body is large (`LARGE_BODY_BYTES` or more: the server
marks it in `large_body`) runs in this lane: one job at a time, in a pool thread, each
job charged the CPU time its thread spent (`time.thread_time`) against a budget that
refills at `SHARE` CPU-seconds per second, up to `BURST_S`. A job starts only while
the budget is not in debt; so, however fast large bodies arrive, their work takes no
more than about `SHARE` of one core over any stretch longer than the burst, and the
rest of the process keeps the remainder. What waits is the large bodies' own answers
(and their bytes, in the body budget, which bounds how many may wait). Of the tenants
waiting, the one whose jobs used the least CPU goes next (a tenant that starts to wait
counts from the least of those already waiting or running, so no credit is banked
while away): a client whose bodies cost 150 ms each gets no more of the lane than one
whose cost 5 ms, rather than 30 times as much by plain turns. Within a tenant, the
same between its requests (`Flow`): one client's light request is not queued behind
the same tenant's heavy ones.

A body under the limit never waits here: small requests are not slowed to make room.
And the budget binds only while there are small requests to protect: one in flight,
or one ended less than `QUIET_S` ago (the server marks them, `CpuLane.small`). With
none, a job starts in its turn whatever the budget, and its debt is forgiven: a
client sending large bodies alone is not slowed for no one.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = ["BURST_S", "LARGE_BODY_BYTES", "QUIET_S", "SHARE", "CpuLane", "Flow", "cpu_lane",
           "large_body",
           "run_in_lane"]

T = TypeVar("T")

LARGE_BODY_BYTES = 256 * 1024
"""A body this large is parsed in a thread, and all its CPU work runs in the lane."""
SHARE = 0.1
"""CPU-seconds the lane may spend per second, over time (of one core)."""
BURST_S = 0.25
"""CPU-seconds it may spend at once after a quiet while (a lone large request)."""

SWITCH_INTERVAL_S = 0.001
"""The interpreter's thread switch interval from the first request (`_settle_process`)."""
QUIET_S = 0.25
"""Seconds after the last small request ends during which the budget still binds."""



class Flow:
    """One large-body request in the lane: what its jobs used is kept while it lives."""

    __slots__ = ("__weakref__",)


# Set by the server for the request (its task) whose body is large.
large_body: ContextVar[Flow | None] = ContextVar("kvgate_large_body", default=None)


class _Abandoned(Exception):
    """A job whose awaiter left before it started: it never runs."""


@dataclass
class _Job:
    lock: threading.Lock = field(default_factory=threading.Lock)
    started: bool = False
    abandoned: bool = False


class CpuLane:
    """`await lane.run(tenant, call, fn, *args)`: `fn(*args)` in its turn and within the
    budget, where `call(job)` runs the no-argument `job` in a thread."""

    def __init__(self, share: float = SHARE, burst_s: float = BURST_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.share = share
        self.burst_s = burst_s
        self._clock = clock
        self._balance = burst_s
        self._at = clock()
        self._busy = False
        self._waiting: dict[str, list[tuple[asyncio.Future[None], Flow | None]]] = {}
        self._turns: deque[str] = deque()  # tenants waiting, oldest first
        self._used: dict[str, float] = {}  # CPU-s charged per tenant while the lane is busy
        self._running = ""
        self._flow_used: weakref.WeakKeyDictionary[Flow, float] = weakref.WeakKeyDictionary()
        self._timer: asyncio.TimerHandle | None = None
        self.spent_s = 0.0  # CPU-seconds charged, all told
        self.jobs = 0
        self.waited = 0  # jobs that did not start at once
        self.small_inflight = 0
        self._small_ended = -float("inf")

    @contextlib.contextmanager
    def small(self) -> Iterator[None]:
        """A small request in flight: the budget binds while one is."""
        self.small_inflight += 1
        try:
            yield
        finally:
            self.small_inflight -= 1
            self._small_ended = self._clock()

    def _protecting(self) -> bool:
        return (self.small_inflight > 0
                or self._clock() - self._small_ended < QUIET_S)

    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    async def run(self, tenant: str, call: Callable[[Callable[[], T]], Awaitable[T]],
                  fn: Callable[..., T], *args: Any, flow: Flow | None = None) -> T:
        loop = asyncio.get_running_loop()
        await self._acquire(tenant, flow, loop)
        job = _Job()

        def timed() -> T:
            with job.lock:
                if job.abandoned:
                    raise _Abandoned
                job.started = True
            t0 = time.thread_time()
            try:
                return fn(*args)
            finally:
                spent = time.thread_time() - t0
                with contextlib.suppress(RuntimeError):  # a closed loop: no lane to free
                    loop.call_soon_threadsafe(self._release, spent, tenant, flow)

        try:
            return await call(timed)
        finally:
            with job.lock:
                if not job.started:  # it never ran (cancelled first): nothing to charge
                    job.abandoned = True
                    self._release(0.0, tenant, flow)

    async def _acquire(self, tenant: str, flow: Flow | None,
                       loop: asyncio.AbstractEventLoop) -> None:
        self.jobs += 1
        if not self._busy and not self._turns and self._may_start():
            self._grant(tenant)
            return
        self.waited += 1
        turn: asyncio.Future[None] = loop.create_future()
        queue = self._waiting.get(tenant)
        if queue is None:
            queue = self._waiting[tenant] = []
            active = [self._used.get(t, 0.0) for t in self._turns]
            if self._busy:
                active.append(self._used.get(self._running, 0.0))
            self._used[tenant] = max(self._used.get(tenant, 0.0), min(active, default=0.0))
            self._turns.append(tenant)
        if flow is not None and flow not in self._flow_used:  # from the least of its tenant's
            self._flow_used[flow] = min((self._flow_used.get(f, 0.0) for _, f in queue
                                         if f is not None), default=0.0)
        queue.append((turn, flow))
        self._next(loop)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._release(0.0, tenant, flow)  # granted, then cancelled: pass it on
            raise

    def _may_start(self) -> bool:
        if self._refilled() >= 0:
            return True
        if self._protecting():
            return False
        self._balance = 0.0  # no one to protect: the debt is forgiven
        return True

    def _refilled(self) -> float:
        now = self._clock()
        self._balance = min(self.burst_s, self._balance + (now - self._at) * self.share)
        self._at = now
        return self._balance

    def _grant(self, tenant: str) -> None:
        self._busy = True
        self._running = tenant

    def _release(self, spent_s: float, tenant: str, flow: Flow | None) -> None:
        self._balance -= spent_s
        self.spent_s += spent_s
        self._used[tenant] = self._used.get(tenant, 0.0) + spent_s
        if flow is not None:
            self._flow_used[flow] = self._flow_used.get(flow, 0.0) + spent_s
        self._busy = False
        self._next(asyncio.get_running_loop())
        if not self._busy and not self._turns:
            self._used.clear()  # idle: every tenant starts even again

    def _next(self, loop: asyncio.AbstractEventLoop) -> None:
        """The lane is free: the waiting tenant that used the least CPU (the longest
        waiting among equals) gets it for its oldest job, at once or once the budget
        is out of debt."""
        if self._busy or self._timer is not None:
            return
        while self._turns:
            if not self._may_start():
                wait_s = min(-self._balance / self.share, QUIET_S)
                self._timer = loop.call_later(wait_s, self._wake, loop)
                return
            tenant = min(self._turns, key=lambda t: self._used.get(t, 0.0))
            self._turns.remove(tenant)
            queue = self._waiting[tenant]
            queue[:] = [entry for entry in queue if not entry[0].done()]  # cancelled
            granted = False
            if queue:  # its request whose jobs used the least (the oldest among equals)
                k = min(range(len(queue)), key=lambda j: self._used_by(queue[j][1]))
                self._grant(tenant)
                granted = True
                queue.pop(k)[0].set_result(None)
            if queue:
                self._turns.append(tenant)
            else:
                del self._waiting[tenant]
            if granted:
                return

    def _used_by(self, flow: Flow | None) -> float:
        return 0.0 if flow is None else self._flow_used.get(flow, 0.0)

    def _wake(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        self._next(loop)


_LANES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, CpuLane] = (
    weakref.WeakKeyDictionary())


async def run_in_lane(tenant: str, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in the lane, in a thread of the loop's default executor, for the
    request marked in `large_body`."""
    loop = asyncio.get_running_loop()
    return await cpu_lane().run(tenant, lambda job: loop.run_in_executor(None, job),
                                fn, *args, flow=large_body.get())


def cpu_lane() -> CpuLane:
    """This event loop's lane (one per loop: its futures and timers belong to it)."""
    loop = asyncio.get_running_loop()
    lane = _LANES.get(loop)
    if lane is None:
        lane = _LANES[loop] = CpuLane()
        _settle_process()
    return lane


def _settle_process() -> None:
    """Once per process, at its first request (a lane is made for the loop then):

    - leave what the process holds now (tokenizers, templates, config: a started
      proxy's heap) out of the cyclic GC's full collections (`gc.freeze`). A full
      collection walks every tracked object holding the GIL: 26 ms for that heap
      alone, and a large body's parse, checks and render allocate enough to start one
      every body or two. Frozen objects are still freed when their last reference
      goes; only a reference cycle among them is never collected, and what lives from
      startup to the first request barely holds any;
    - a thread switch interval of `SWITCH_INTERVAL_S`: a thread in Python code hands
      the GIL on only that often (5 ms by default), and the event loop, woken several
      times in one small request, waited up to that each time behind a lane job."""
    global _FROZEN
    if not _FROZEN:
        _FROZEN = True
        gc.freeze()
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))


_FROZEN = False
