"""The exact count of a request admitted on a bound of its prompt, made while the
backend starts on it (`Gate._admit_on_bound`), and its end on every way out."""

from __future__ import annotations

import asyncio
import logging
import time

from proxy.ask import Record
from proxy.sharing import counted_with_blocks
from proxy.tokenize import PromptCounter, RenderedChat
from proxy.validation import ValidRequest

__all__ = ["close_late", "count_late", "log_resize_failure"]

_log = logging.getLogger("kvgate")


async def count_late(counter: PromptCounter, rendered: RenderedChat, *, block_tokens: int,
                     scope: str, keyed: ValidRequest | None) -> tuple[int, float, tuple[str, ...]]:
    """(exact prompt tokens, seconds it took, block keys): the keys where prefixes are
    shared (`keyed`: the request, whose ids they need), else none."""
    # Created before the forward, so first in the loop's queue: step aside once, and
    # aiohttp's body-writing task (created as the forward sends its headers) runs
    # first; the request is on the wire while this counts.
    await asyncio.sleep(0)
    t0 = time.perf_counter()
    if keyed is not None:
        counted = await counted_with_blocks(counter, keyed, block_tokens, scope)
        if counted is not None:
            return counted[0], time.perf_counter() - t0, counted[1]
    tokens = await counter.count_rendered_async(rendered)
    return tokens, time.perf_counter() - t0, ()


def log_resize_failure(task: asyncio.Future[int]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        _log.warning("a lease's resize to its exact count failed: %s", exc)


def close_late(task: asyncio.Task[tuple[int, float, tuple[str, ...]]], record: Record) -> None:
    """On every way out: a count still running (the reply never began: upstream error,
    client gone) is stopped; a finished one is read, so its outcome is never left
    unretrieved, and its count goes to the log line."""
    if not task.done():
        task.cancel()
    elif not task.cancelled() and task.exception() is None:
        record.prompt_tokens = task.result()[0]
