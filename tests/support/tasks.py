"""Background checkers in tests: stop them so that what they raised reaches pytest."""

from __future__ import annotations

import asyncio
from typing import Any


async def stop(task: asyncio.Task[Any]) -> None:
    """Cancel `task` and re-raise its failure.

    An assertion inside a task that is only cancelled, never awaited, ends the task
    and is never seen (at most a "Task exception was never retrieved" log line).
    """
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        if not task.cancelled():
            raise  # the awaiting test itself is being cancelled
