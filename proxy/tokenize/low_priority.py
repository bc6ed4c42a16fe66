"""Long tokenizer calls that release the GIL, run on a thread at the lowest OS priority.

Some counts are one long call that no cut can shorten: BPE of a whitespace run of
megabytes is one piece (`proxy.tokenize.guard`), ~3 s of CPU for 4 MB. The call
releases the GIL, so it does not stop the event loop, but it takes a whole core for
those seconds: on a 2-core machine the small chats beside it lost a third of their
throughput (benchmarks/README.md, `bench_hostile`, "spaces"). The lane of large bodies
(`proxy.tokenize.cpu_lane`) bounds the share of CPU such work takes by spacing jobs,
and cannot cut one short.

Here such a call runs on one thread whose scheduling priority is the lowest the OS
gives without privilege (nice 19 on Linux, set on that thread alone): it takes the
CPU nothing else wants and, whenever the loop, the engine or another process has work,
runs at about 1/70 of their weight. Only calls that release the GIL for their whole
length come here: a thread at low priority holding the GIL would make every other
thread wait on it (priority inversion). The caller waits on the result with the GIL
released; a caller on an event loop's thread runs the call itself, as before (it
must not block its loop on a slow thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["NICE", "run_low_priority"]

T = TypeVar("T")

NICE = 19
"""The thread's nice value: the lowest priority an unprivileged process may take."""

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None


def _lower_priority() -> None:
    """On Linux a thread is a task of its own: `setpriority` on its id moves it alone."""
    if sys.platform.startswith("linux"):
        # a sandbox that forbids it: the call runs, at normal priority
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)


def _pool() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgate-low",
                                           initializer=_lower_priority)
        return _executor


def run_low_priority(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on the low-priority thread, waited for here (`fn` must release the
    GIL); on a thread that runs an event loop, or on that thread itself, in place."""
    if threading.current_thread().name.startswith("kvgate-low"):
        return fn(*args)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _pool().submit(fn, *args).result()
    return fn(*args)
