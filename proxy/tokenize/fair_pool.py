"""The count pool, shared between clients by turns, not by how much each one sends.

Counting off the loop runs in a few threads (one per core). Handed to the executor
directly, jobs run first come first served: a client with many long prompts in
flight (each counted chunk by chunk, `proxy.tokenize.long_text`) held most of the
threads, and everyone else's counts waited behind its chunks. `FairPool` keeps the
executor's own queue empty (at most one job per thread is handed to it) and decides
itself which job runs next: the waiting client with the fewest jobs running, the one
waiting longest among equals; within one client, in order. A client's share so no
longer grows with the number of prompts it has in flight (tests/test_chunked_counting.py:
four concurrent long counts of one client against one of another took 3.1 chunks to 1
by plain turns, 2.0 to 2.7 to 1 this way, on two threads; not 1 to 1, because a client
between two of its chunks is briefly not waiting, and a free thread is not held idle
for it).

The client is the tenant admission keys on (`proxy.clients`: configured client keys,
else one default tenant), set for the request's counting by the gate in
`counting_for`. A context variable rather than a parameter: it is scheduling
metadata of the request, like a trace id, and counting's results never depend on it.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

from proxy.tokenize.cpu_lane import cpu_lane, large_body

__all__ = ["FairPool", "counting_for"]

T = TypeVar("T")

# The tenant whose request is being counted ("" for the default tenant).
counting_for: ContextVar[str] = ContextVar("kvgate_counting_for", default="")


@dataclass
class _LoopState:
    """One event loop's turns: jobs running in the executor, jobs waiting per tenant."""

    running: int = 0
    running_by: dict[str, int] = field(default_factory=dict)
    waiting: dict[str, deque[asyncio.Future[None]]] = field(default_factory=dict)
    turns: deque[str] = field(default_factory=deque)  # tenants with jobs waiting, oldest first


class FairPool:
    """`await pool.run(fn, *args)`: `fn(*args)` in the executor, in turn by tenant."""

    def __init__(self, executor: Callable[[], Executor], slots: int) -> None:
        self._executor = executor
        self.slots = max(1, slots)
        self._states: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState] = (
            weakref.WeakKeyDictionary())

    def waiting(self) -> int:
        """Jobs waiting for a thread in this loop (for tests and metrics)."""
        state = self._states.get(asyncio.get_running_loop())
        return 0 if state is None else sum(len(q) for q in state.waiting.values())

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """A large body's jobs run in the CPU lane (`proxy.tokenize.cpu_lane`) first, in
        its turn and budget, then in a thread of this pool as any other."""
        flow = large_body.get()
        if flow is not None:
            return await cpu_lane().run(counting_for.get(), self._run, fn, *args, flow=flow)
        return await self._run(fn, *args)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        state = self._states.get(loop)
        if state is None:
            state = self._states[loop] = _LoopState()
        tenant = counting_for.get()
        if state.running >= self.slots or state.turns:
            await self._wait_turn(state, loop, tenant)
        else:
            _start(state, tenant)
        job = self._executor().submit(fn, *args)
        # The thread is free when the job ends, not when its awaiter is cancelled.
        job.add_done_callback(
            lambda _: loop.call_soon_threadsafe(self._done, state, tenant))
        return await asyncio.wrap_future(job, loop=loop)

    async def _wait_turn(self, state: _LoopState, loop: asyncio.AbstractEventLoop,
                         tenant: str) -> None:
        turn: asyncio.Future[None] = loop.create_future()
        queue = state.waiting.get(tenant)
        if queue is None:
            queue = state.waiting[tenant] = deque()
            state.turns.append(tenant)
        queue.append(turn)
        try:
            await turn  # granted: `running` already counts this job
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._done(state, tenant)  # granted, then cancelled: pass the thread on
            raise

    def _done(self, state: _LoopState, tenant: str) -> None:
        """A thread is free: the waiting tenant with the fewest jobs running (the
        longest waiting among equals) gets it, for its oldest job."""
        state.running -= 1
        left = state.running_by[tenant] - 1
        if left:
            state.running_by[tenant] = left
        else:
            del state.running_by[tenant]
        while state.turns and state.running < self.slots:
            nxt = min(state.turns, key=lambda t: state.running_by.get(t, 0))
            state.turns.remove(nxt)
            queue = state.waiting[nxt]
            while queue and queue[0].done():  # cancelled while waiting
                queue.popleft()
            if queue:
                _start(state, nxt)
                queue.popleft().set_result(None)
            if queue:
                state.turns.append(nxt)
            else:
                del state.waiting[nxt]


def _start(state: _LoopState, tenant: str) -> None:
    state.running += 1
    state.running_by[tenant] = state.running_by.get(tenant, 0) + 1
