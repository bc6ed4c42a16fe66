"""When a queued request could start: the prediction behind admission by deadline.

Pure arithmetic, no asyncio: releases at the recent rate (tokens per second) free room
in queue order; each waiter takes its tokens when the freed room covers them, unless
its deadline comes first, in which case it leaves the queue without taking any. In a
deep queue most of those ahead time out; counting them all would refuse requests that
would have got in (measured with `kvgate simulate`: see `proxy.admission`).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["predict_waits"]


def predict_waits(rate_tokens_per_s: float, free_tokens: int,
                  queue: Iterable[tuple[int, float]], now: float) -> list[tuple[float, bool]]:
    """For each (tokens, deadline) in queue order: (seconds until it could start, whether
    that is by its deadline). Needs a rate > 0.

    Example: rate 100/s, 50 tokens free, queue [(100, now+5), (100, now+0.2), (50, now+1)]:
    the first waits 0.5 s and gets in; the second would wait 1.5 s, past its deadline, and
    takes nothing; the third waits 1.0 s: in time.
    """
    out: list[tuple[float, bool]] = []
    need = -free_tokens
    for tokens, deadline in queue:
        wait_s = max(0, need + tokens) / rate_tokens_per_s
        in_time = now + wait_s <= deadline
        if in_time:
            need += tokens
        out.append((wait_s, in_time))
    return out
