"""Counting text too long for the event loop: in the pool, chunk by chunk, stoppable.

`proxy.tokenize.chunked` says where text may be cut and why counting long text in one
call was a problem; this is the counting itself. Every heavy step (the split on added
tokens, cache lookups, each chunk, the block keys) is one pool job, so the loop only
adds and compares between them, and:

* `limit` (the most prompt tokens that could ever be admitted) stops counting as soon
  as the count passes it, or before any encoding where the text's length alone proves
  it (`floor_tokens`): `CountExceeded`;
* a cancelled request (its client gone) stops at the chunk in flight;
* each chunk is one job of the count pool (`FairPool`): concurrent long counts take
  turns, and clients take turns before requests do.

Counts and ids are exactly those of the one-call paths (`SegmentCounter.count`,
`keys`, `encode_plain`): chunks are cut only where `Cuts` proves it, and segments
counted here are remembered in the count cache as those paths would.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Callable, Iterator

from proxy.prefix_blocks import ID_BYTES, block_keys_of_bytes
from proxy.tokenize.base import Encoder
from proxy.tokenize.cache import IdPart, SegmentCounter
from proxy.tokenize.chunked import CHUNK_CHARS, CountExceeded
from proxy.tokenize.fair_pool import FairPool

__all__ = ["LongText"]

Keyed = tuple[int, tuple[str, ...]]


class LongText:
    """The long-text count paths of one model's `TokenCounter`."""

    def __init__(self, encoder: Encoder, segments: SegmentCounter,
                 pool: Callable[[], FairPool]) -> None:
        self._encoder = encoder
        self._segments = segments
        self._pool = pool

    def check_floor(self, text: str, limit: int | None) -> None:
        """`CountExceeded` where the length alone proves more than `limit` tokens."""
        if limit is not None and len(text) > limit:  # the floor is at most the length
            floor = self._encoder.min_rendered_tokens(text)
            if floor > limit:
                raise CountExceeded(floor, limit)

    async def count_rendered(self, text: str, limit: int | None) -> int:
        """`SegmentCounter.count(text)`: short new segments in batches, long ones
        chunk by chunk."""
        self.check_floor(text, limit)
        pool, segments = self._pool(), self._segments
        total, todo = await pool.run(segments.plan, text)
        for job in _batches(todo):
            _check(total, limit)
            if isinstance(job, list):
                total += await pool.run(segments.finish, job)
                continue
            count, _, _ = await self._encode(job, before=total, limit=limit)
            segments.remember(job, count)
            total += count
        return total

    async def keys_rendered(self, text: str, block_tokens: int, scope: str,
                            limit: int | None) -> Keyed:
        """`SegmentCounter.keys(text, ...)`: long new segments encoded chunk by chunk,
        then the id stream's keys in one job."""
        self.check_floor(text, limit)
        pool, segments = self._pool(), self._segments
        parts, _ = await pool.run(segments.plan_ids, text)
        known = sum(_known_tokens(p) for p in parts)
        _check(known, limit)
        ready: list[IdPart] = []
        for part in parts:
            if isinstance(part, str) and len(part) >= CHUNK_CHARS:
                count, _, data = await self._encode(part, before=known, limit=limit,
                                                    as_bytes=True)
                assert data is not None
                known += count
                part = segments.encoded_part(part, data)
            ready.append(part)
        return await pool.run(segments.finish_keys, ready, block_tokens,
                                          scope)

    async def count_plain(self, prompt: str, limit: int | None,
                          one_call: Callable[[str], int]) -> int:
        """A completion prompt's count with the tokenizer's BOS rule (`encode_plain`);
        `one_call` counts it where the encoder gives no parts."""
        self.check_floor(prompt, limit)
        pool = self._pool()
        plan = await pool.run(self._encoder.plain_parts, prompt)
        if plan is None:
            return await pool.run(one_call, prompt)
        parts, bos = plan
        total, first = 0, None
        for part in parts:
            _check(total, limit)
            head: int | None
            if isinstance(part, int):
                count, head = 1, part
            else:
                count, head, _ = await self._encode(part, before=total, limit=limit)
            first = head if first is None else first
            total += count
        return total + int(bos is not None and first != bos)

    async def keys_plain(self, prompt: str, block_tokens: int, scope: str,
                         limit: int | None, one_call: Callable[[str], list[int]]) -> Keyed:
        """A completion prompt's count and block keys (`encode_plain`'s ids)."""
        self.check_floor(prompt, limit)
        pool = self._pool()
        plan = await pool.run(self._encoder.plain_parts, prompt)
        if plan is None:
            ids = await pool.run(one_call, prompt)
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
                    count, head, maybe = await self._encode(part, before=total, limit=limit,
                                                            as_bytes=True)
                    assert maybe is not None
                    chunk = maybe
                first = head if first is None else first
                total += count
                out.append(chunk)
            if bos is not None and first != bos:
                out.insert(0, array("I", (bos,)).tobytes())
            data = b"".join(out)
        keys = await pool.run(
            functools.partial(block_keys_of_bytes, data, block_tokens, scope=scope))
        return len(data) // ID_BYTES, tuple(keys)

    async def _encode(self, segment: str, *, before: int, limit: int | None,
                      as_bytes: bool = False) -> tuple[int, int | None, bytes | None]:
        """One segment in the pool, one chunk per job: -> (count, first id, ids as
        `array("I")` bytes where asked for); `CountExceeded` as soon as `before` + the
        count so far passes `limit`."""
        pool, cuts, encode = self._pool(), self._encoder.cuts, self._segments.encode_chunk
        count, first, start = 0, None, 0
        out: list[bytes] = []
        while True:
            chunk = await pool.run(encode, segment, start, cuts,
                                               CHUNK_CHARS, as_bytes)
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
    """Segments to encode, in order: runs of short ones together (one pool job of at
    most about `CHUNK_CHARS` characters), each long one alone (chunk by chunk)."""
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
