"""Counting text too long for the event loop: chunk by chunk, stoppable, in turns.

`proxy.tokenize.chunked` says where text may be cut and why counting long text in one
call was a problem; this is the counting itself. Each count path is a plan of steps
(a generator that yields each heavy step: the split on added tokens, cache lookups,
each chunk, the block keys) run by one of two drivers:

* `LongText.run`, in the proxy: each step is one job of the count pool (`FairPool`),
  so the loop only adds and compares between them, a cancelled request (its client
  gone) stops at the step in flight, and clients take turns chunk by chunk;
* `run_inline`, in a count worker (its own process, one request at a time): each step
  runs at once.

Either way `limit` (the most prompt tokens that could ever be admitted) stops counting
as soon as the count passes it, or before any encoding where the text's length alone
proves it (`floor_tokens`): `CountExceeded`. Counts and ids are exactly those of the
one-call paths (`SegmentCounter.count`, `keys`, `encode_plain`): chunks are cut only
where `Cuts` proves it, and segments counted here are remembered in the count cache
as those paths would.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Callable, Generator, Iterator
from typing import Any, TypeVar

from proxy.prefix_blocks import ID_BYTES, block_keys_of_bytes
from proxy.tokenize.base import Encoder
from proxy.tokenize.cache import IdPart, SegmentCounter
from proxy.tokenize.chunked import CHUNK_CHARS, CountExceeded
from proxy.tokenize.fair_pool import FairPool

__all__ = ["LongText", "run_inline"]

T = TypeVar("T")
Keyed = tuple[int, tuple[str, ...]]
# A step: a function and its arguments, to run off the loop; it sends back the result.
Step = tuple[Callable[..., Any], tuple[Any, ...]]
Steps = Generator[Step, Any, T]


def run_inline(steps: Steps[T]) -> T:
    """A plan run step by step in this thread (a count worker's)."""
    try:
        fn, args = next(steps)
        while True:
            fn, args = steps.send(fn(*args))
    except StopIteration as done:
        result: T = done.value
        return result


class LongText:
    """The long-text count paths of one model's `TokenCounter`, as plans of steps."""

    def __init__(self, encoder: Encoder, segments: SegmentCounter,
                 pool: Callable[[], FairPool]) -> None:
        self._encoder = encoder
        self._segments = segments
        self._pool = pool

    async def run(self, steps: Steps[T]) -> T:
        """A plan run in the count pool, one job per step."""
        pool = self._pool()
        try:
            fn, args = next(steps)
            while True:
                fn, args = steps.send(await pool.run(fn, *args))
        except StopIteration as done:
            result: T = done.value
            return result

    def check_floor(self, text: str, limit: int | None) -> None:
        """`CountExceeded` where the length alone proves more than `limit` tokens."""
        if limit is not None and len(text) > limit:  # the floor is at most the length
            floor = self._encoder.min_rendered_tokens(text)
            if floor > limit:
                raise CountExceeded(floor, limit)

    def count_rendered(self, text: str, limit: int | None) -> Steps[int]:
        """`SegmentCounter.count(text)`: short new segments in batches, long ones
        chunk by chunk."""
        self.check_floor(text, limit)
        segments = self._segments
        total, todo = yield segments.plan, (text,)
        for job in _batches(todo):
            _check(total, limit)
            if isinstance(job, list):
                total += yield segments.finish, (job,)
                continue
            count, _, _ = yield from self._encode(job, before=total, limit=limit)
            segments.remember(job, count)
            total += count
        return int(total)

    def keys_rendered(self, text: str, block_tokens: int, scope: str,
                      limit: int | None) -> Steps[Keyed]:
        """`SegmentCounter.keys(text, ...)`: long new segments encoded chunk by chunk,
        then the id stream's keys in one step."""
        self.check_floor(text, limit)
        segments = self._segments
        parts, _ = yield segments.plan_ids, (text,)
        known = sum(_known_tokens(p) for p in parts)
        _check(known, limit)
        ready: list[IdPart] = []
        for part in parts:
            if isinstance(part, str) and len(part) >= CHUNK_CHARS:
                count, _, data = yield from self._encode(part, before=known, limit=limit,
                                                         as_bytes=True)
                assert data is not None
                known += count
                part = segments.encoded_part(part, data)
            ready.append(part)
        keyed: Keyed = yield segments.finish_keys, (ready, block_tokens, scope)
        return keyed

    def count_plain(self, prompt: str, limit: int | None,
                    one_call: Callable[[str], int]) -> Steps[int]:
        """A completion prompt's count with the tokenizer's BOS rule (`encode_plain`);
        `one_call` counts it where the encoder gives no parts."""
        self.check_floor(prompt, limit)
        plan = yield self._encoder.plain_parts, (prompt,)
        if plan is None:
            whole: int = yield one_call, (prompt,)
            return whole
        parts, bos = plan
        total, first = 0, None
        for part in parts:
            _check(total, limit)
            head: int | None
            if isinstance(part, int):
                count, head = 1, part
            else:
                count, head, _ = yield from self._encode(part, before=total, limit=limit)
            first = head if first is None else first
            total += count
        return total + int(bos is not None and first != bos)

    def keys_plain(self, prompt: str, block_tokens: int, scope: str, limit: int | None,
                   one_call: Callable[[str], list[int]]) -> Steps[Keyed]:
        """A completion prompt's count and block keys (`encode_plain`'s ids)."""
        self.check_floor(prompt, limit)
        plan = yield self._encoder.plain_parts, (prompt,)
        if plan is None:
            ids = yield one_call, (prompt,)
            data = array("I", ids).tobytes()
        else:
            parts, bos = plan
            out: list[bytes] = []
            total, first = 0, None
            for part in parts:
                _check(total, limit)
                head: int | None
                if isinstance(part, int):
                    count, head, chunk = 1, part, array("I", (part,)).tobytes()
                else:
                    count, head, maybe = yield from self._encode(
                        part, before=total, limit=limit, as_bytes=True)
                    assert maybe is not None
                    chunk = maybe
                first = head if first is None else first
                total += count
                out.append(chunk)
            if bos is not None and first != bos:
                out.insert(0, array("I", (bos,)).tobytes())
            data = b"".join(out)
        keys = yield functools.partial(block_keys_of_bytes, scope=scope), (data, block_tokens)
        return len(data) // ID_BYTES, tuple(keys)

    def _encode(self, segment: str, *, before: int, limit: int | None,
                as_bytes: bool = False) -> Steps[tuple[int, int | None, bytes | None]]:
        """One segment, one step per chunk: -> (count, first id, ids as `array("I")`
        bytes where asked for); `CountExceeded` as soon as `before` + the count so far
        passes `limit`."""
        cuts, encode = self._encoder.cuts, self._segments.encode_chunk
        count, first, start = 0, None, 0
        out: list[bytes] = []
        while True:
            chunk = yield encode, (segment, start, cuts, CHUNK_CHARS, as_bytes)
            first = chunk.first if first is None else first
            count += chunk.count
            if chunk.data is not None:
                out.append(chunk.data)
            _check(before + count, limit)
            start = chunk.end
            if start >= len(segment):
                return count, first, b"".join(out) if as_bytes else None


def _check(tokens: int, limit: int | None) -> None:
    if limit is not None and tokens > limit:
        raise CountExceeded(tokens, limit)


def _known_tokens(part: IdPart) -> int:
    if isinstance(part, bytes):
        return len(part) // ID_BYTES
    if isinstance(part, tuple):
        return len(part[1].data) // ID_BYTES
    return 0


def _batches(todo: list[str]) -> Iterator[list[str] | str]:
    """Segments to encode, in order: runs of short ones together (one step of at most
    about `CHUNK_CHARS` characters), each long one alone (chunk by chunk)."""
    batch: list[str] = []
    size = 0
    for segment in todo:
        if len(segment) >= CHUNK_CHARS:
            if batch:
                yield batch
                batch, size = [], 0
            yield segment
            continue
        if size + len(segment) > CHUNK_CHARS and batch:
            yield batch
            batch, size = [], 0
        batch.append(segment)
        size += len(segment)
    if batch:
        yield batch
