"""A count cache for the parts of prompts that repeat.

Chats re-send their whole history every turn and many share one system prompt, so
most of a rendered prompt has been counted before. A rendered prompt is split on
the tokenizer's added/special tokens (`<|im_start|>`, `<|im_end|>`...); where the
engine's tokenizer encodes each segment between them on its own,

    count(text) = sum(count(segment)) + number of special tokens

and a segment's count can be remembered. That additivity is not universal: a
`Metaspace` pre-tokenizer with `prepend_scheme: "first"` marks only the text at
offset 0 of the whole input. So `HFEncoder` checks it when it loads (by structure
and on probe strings, `proxy.tokenize.encoders`) and, where it fails, does not split:
the whole prompt is one segment. The tests check counts against transformers on the
whole corpus. Only segments of at least `MIN_CACHED_CHARS` are cached: short ones
("\\n", "assistant\\n") are cheaper to encode than to remember.

Memory is bounded by an LRU over the segments' sizes in bytes.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from proxy.tokenize.guard import CountFailed, is_panic

__all__ = ["CacheStats", "CountCache", "SegmentCounter"]

MIN_CACHED_CHARS = 64
DEFAULT_CACHE_BYTES = 64 * 2**20
_ENTRY_OVERHEAD_BYTES = 100  # the dict slot, the int, the list links: about this


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheStats:
    hits: int
    misses: int
    size_bytes: int
    entries: int

    def __add__(self, other: CacheStats) -> CacheStats:
        """Several caches of one model (the proxy's and its count workers') as one."""
        return CacheStats(hits=self.hits + other.hits, misses=self.misses + other.misses,
                          size_bytes=self.size_bytes + other.size_bytes,
                          entries=self.entries + other.entries)


class CountCache:
    """Segment text -> token count, least recently used evicted past `max_bytes`."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"count cache size must be >= 0 bytes. Given: {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, int] = OrderedDict()
        self._size_bytes = 0
        self._hits = 0
        self._misses = 0
        self._lock = threading.Lock()

    def get(self, segment: str) -> int | None:
        with self._lock:
            count = self._entries.get(segment)
            if count is None:
                self._misses += 1
                return None
            self._entries.move_to_end(segment)
            self._hits += 1
            return count

    def put(self, segment: str, count: int) -> None:
        size = sys.getsizeof(segment) + _ENTRY_OVERHEAD_BYTES
        if size > self.max_bytes:
            return
        with self._lock:
            if segment in self._entries:
                return
            self._entries[segment] = count
            self._size_bytes += size
            while self._size_bytes > self.max_bytes:
                old, _ = self._entries.popitem(last=False)
                self._size_bytes -= sys.getsizeof(old) + _ENTRY_OVERHEAD_BYTES

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(hits=self._hits, misses=self._misses,
                              size_bytes=self._size_bytes, entries=len(self._entries))


class SegmentCounter:
    """Counts rendered text segment by segment, through the cache where it helps.

    `plan` does the cheap part (split, cache lookups) and returns the segments still
    to encode, so the caller can decide where the expensive part runs: inline when
    little is left, in the thread pool when a long new text would hold the loop.
    """

    def __init__(
        self,
        *,
        split: Callable[[str], list[str | int]],
        encode: Callable[[str], list[int]],
        cache: CountCache | None,
    ) -> None:
        self._split = split
        self._encode = encode
        self.cache = cache

    def plan(self, text: str) -> tuple[int, list[str]]:
        """-> (tokens known now: specials + cache hits, segments still to encode)."""
        known = 0
        todo: list[str] = []
        cache = self.cache
        for part in self._split(text):
            if isinstance(part, int):
                known += 1
            elif cache is not None and len(part) >= MIN_CACHED_CHARS:
                hit = cache.get(part)
                if hit is None:
                    todo.append(part)
                else:
                    known += hit
            else:
                todo.append(part)
        return known, todo

    def finish(self, todo: list[str]) -> int:
        """Encode what `plan` left, remembering the long segments. A panic the encoder
        let through is `CountFailed` (the encoders catch theirs: this is the last net),
        and nothing is cached for the segment it came from."""
        total = 0
        cache = self.cache
        for segment in todo:
            try:
                n = len(self._encode(segment))
            except BaseException as exc:
                if is_panic(exc):
                    raise CountFailed(f"the tokenizer panicked on a segment of "
                                      f"{len(segment)} characters: {exc}") from exc
                raise
            if cache is not None and len(segment) >= MIN_CACHED_CHARS:
                cache.put(segment, n)
            total += n
        return total

    def count(self, text: str) -> int:
        known, todo = self.plan(text)
        return known + self.finish(todo)
