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

The shared-prefix path needs the ids themselves (their block keys, `proxy.prefix_blocks`):
it caches a long segment's ids instead of its count, as `array("I")` bytes (4 per
token, about the segment's own size again), and builds the prompt's id stream from
them and the special tokens' ids. Segments are independent where the count is
additive (above), so that stream is `encode_rendered` of the whole text, id for id.

Memory is bounded by an LRU over the entries' sizes in bytes, ids included.
"""

from __future__ import annotations

import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from proxy.prefix_blocks import ID_BYTES, KeyChain
from proxy.tokenize.guard import CountFailed, is_panic

if TYPE_CHECKING:
    from proxy.tokenize.chunked import Cuts

__all__ = ["CacheStats", "Chunk", "CountCache", "IdPart", "SegmentCounter", "SegmentIds"]

MIN_CACHED_CHARS = 64
MAX_CHAINS = 8  # start states remembered per cached segment (scopes, positions)
DEFAULT_CACHE_BYTES = 64 * 2**20
_ENTRY_OVERHEAD_BYTES = 100  # the dict slot, the int, the list links: about this


def _entry_bytes(segment: str, value: int | SegmentIds) -> int:
    size = sys.getsizeof(segment) + _ENTRY_OVERHEAD_BYTES
    if isinstance(value, int):
        return size
    return size + sys.getsizeof(value.data) + _ENTRY_OVERHEAD_BYTES + value.chain_bytes


# A block key: 16 hex digits, an ASCII str, so each costs the same (`block_keys`).
_KEY_BYTES = sys.getsizeof("0" * 16)


def _chain_bytes(state: tuple[bytes, bytes],
                 chain: tuple[tuple[str, ...], tuple[bytes, bytes]]) -> int:
    keys, (parent, pending) = chain
    return (sys.getsizeof(state[0]) + sys.getsizeof(state[1]) + sys.getsizeof(parent)
            + sys.getsizeof(pending) + sys.getsizeof(keys)
            + len(keys) * _KEY_BYTES + _ENTRY_OVERHEAD_BYTES)


def _id_bytes(ids: list[int]) -> bytes:
    """`array("I", ids).tobytes()`: filled by `fromlist`, which reads the list's items
    directly where the constructor takes each through the sequence protocol; the
    shared-prefix path converts every new segment's ids (1,000 ids: 10.1 -> 7.2 us, medians
    of 30 alternating rounds)."""
    if type(ids) is not list:  # an encoder's other sequence
        return array("I", ids).tobytes()
    out = array("I")
    out.fromlist(ids)  # raises as the constructor does (OverflowError, TypeError)
    return out.tobytes()


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


class SegmentIds:
    """A cached segment's ids (`array("I")` bytes) and, per chain state it was seen in
    (`KeyChain.state`: the last block key and the partial block before it), the block
    keys it added and the state after it: a repeated system prompt is hashed once."""

    __slots__ = ("chain_bytes", "chains", "data")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.chains: dict[tuple[bytes, bytes], tuple[tuple[str, ...], tuple[bytes, bytes]]] = {}
        self.chain_bytes = 0  # what `chains` holds, charged to the cache with the ids


# A part of a rendered text's id stream (`SegmentCounter.plan_ids`): a special token's id
# as bytes, a cached segment and its ids, or a segment still to encode.
IdPart = bytes | str | tuple[str, SegmentIds]


class CountCache:
    """Segment text -> its token count, or its ids (`SegmentIds`, which give the count
    too), least recently used evicted past `max_bytes`; ids and their remembered key
    chains are charged at their size. A count path that needs no ids stores the count;
    the shared-prefix path stores ids, over a count stored before."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"count cache size must be >= 0 bytes. Given: {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, int | SegmentIds] = OrderedDict()
        self._size_bytes = 0
        self._hits = 0
        self._misses = 0
        self._lock = threading.Lock()

    def get(self, segment: str) -> int | None:
        with self._lock:
            value = self._entries.get(segment)
            if value is None:
                self._misses += 1
                return None
            self._entries.move_to_end(segment)
            self._hits += 1
            return value if isinstance(value, int) else len(value.data) // ID_BYTES

    def get_ids(self, segment: str) -> SegmentIds | None:
        """The segment's ids; a miss where only its count is held."""
        with self._lock:
            value = self._entries.get(segment)
            if not isinstance(value, SegmentIds):
                self._misses += 1
                return None
            self._entries.move_to_end(segment)
            self._hits += 1
            return value

    def put(self, segment: str, count: int) -> None:
        self._put(segment, count)

    def put_ids(self, segment: str, ids: bytes) -> SegmentIds:
        """-> the entry (the one held already, where another thread was first)."""
        entry = SegmentIds(ids)
        held = self._put(segment, entry)
        return held if isinstance(held, SegmentIds) else entry

    def remember_chain(self, segment: str, entry: SegmentIds, state: tuple[bytes, bytes],
                       chain: tuple[tuple[str, ...], tuple[bytes, bytes]]) -> None:
        """The keys `entry` adds from `state`, and the state after it (at most
        `MAX_CHAINS` states a segment; nothing for an entry no longer held)."""
        size = _chain_bytes(state, chain)
        with self._lock:
            if (self._entries.get(segment) is not entry or len(entry.chains) >= MAX_CHAINS
                    or state in entry.chains or self._size_bytes + size > self.max_bytes):
                return
            entry.chains[state] = chain
            entry.chain_bytes += size
            self._size_bytes += size

    def _put(self, segment: str, value: int | SegmentIds) -> int | SegmentIds | None:
        """-> what is held for `segment` already, if anything."""
        size = _entry_bytes(segment, value)
        if size > self.max_bytes:
            return None
        with self._lock:
            held = self._entries.get(segment)
            if held is not None:
                if isinstance(held, SegmentIds) or isinstance(value, int):
                    return held  # ids are kept over a count; one of each kind is enough
                self._size_bytes -= _entry_bytes(segment, held)
                self._entries.move_to_end(segment)
            self._entries[segment] = value
            self._size_bytes += size
            while self._size_bytes > self.max_bytes:
                old, gone = self._entries.popitem(last=False)
                self._size_bytes -= _entry_bytes(old, gone)
            return None

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(hits=self._hits, misses=self._misses,
                              size_bytes=self._size_bytes, entries=len(self._entries))


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk of a long segment, encoded (`SegmentCounter.encode_chunk`)."""

    count: int
    first: int | None  # its first id (a plain prompt's BOS rule reads it)
    end: int  # where the next chunk starts
    data: bytes | None  # its ids as `array("I")` bytes, where asked for


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
        self._special_bytes: dict[int, bytes] = {}  # a special token's id, as bytes

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
            n = len(self._encoded(segment))
            if cache is not None and len(segment) >= MIN_CACHED_CHARS:
                cache.put(segment, n)
            total += n
        return total

    def count(self, text: str) -> int:
        known, todo = self.plan(text)
        return known + self.finish(todo)

    def encode_chunk(self, segment: str, start: int, cuts: Cuts | None, size: int,
                     as_bytes: bool) -> Chunk:
        """The chunk of `segment` from `start` to the first cut at or after
        `start + size` (its end where there is none), encoded; failures as `finish`'s."""
        end = len(segment)
        if cuts is not None and start + size < end:
            end = cuts.next_cut(segment, start + size) or end
        ids = self._encoded(segment if start == 0 and end == len(segment)
                            else segment[start:end])
        return Chunk(count=len(ids), first=ids[0] if ids else None, end=end,
                     data=_id_bytes(ids) if as_bytes else None)

    def remember(self, segment: str, count: int) -> None:
        """A segment counted chunk by chunk, as `finish` would have remembered it."""
        if self.cache is not None and len(segment) >= MIN_CACHED_CHARS:
            self.cache.put(segment, count)

    def encoded_part(self, segment: str, data: bytes) -> IdPart:
        """A segment encoded chunk by chunk (its ids as bytes), as `finish_keys` would
        have remembered it: a cache entry where long, else the ids alone."""
        if self.cache is not None and len(segment) >= MIN_CACHED_CHARS:
            return segment, self.cache.put_ids(segment, data)
        return data

    def plan_ids(self, text: str) -> tuple[list[IdPart], int]:
        """-> (the id stream's parts in order: special tokens' ids as `array("I")`
        bytes, cache hits as (segment, `SegmentIds`), segments still to encode as text;
        how many tokens are known now and characters are still to encode, together).
        `finish_keys` and `finish_ids` join them."""
        parts: list[IdPart] = []
        size = 0
        cache = self.cache
        special = self._special_bytes
        for part in self._split(text):
            if isinstance(part, int):
                data = special.get(part)
                if data is None:
                    data = special[part] = array("I", (part,)).tobytes()
                parts.append(data)
                size += 1
                continue
            if cache is not None and len(part) >= MIN_CACHED_CHARS:
                hit = cache.get_ids(part)
                if hit is not None:
                    parts.append((part, hit))
                    size += len(hit.data) // ID_BYTES
                    continue
            parts.append(part)
            size += len(part)
        return parts, size

    def finish_keys(self, parts: list[IdPart], block_tokens: int,
                    scope: str) -> tuple[int, tuple[str, ...]]:
        """The exact count and `block_keys` of the whole text's ids: what `plan_ids`
        left encoded (long segments' ids remembered), a cached segment's keys reused
        where it was seen from the same chain state before; failures as in `finish`."""
        chain = KeyChain(block_tokens, scope=scope)
        cache = self.cache
        for part in parts:
            if isinstance(part, bytes):
                chain.feed(part)
                continue
            if isinstance(part, str):
                data = _id_bytes(self._encoded(part))
                if cache is None or len(part) < MIN_CACHED_CHARS:
                    chain.feed(data)
                    continue
                segment, entry = part, cache.put_ids(part, data)
            else:
                segment, entry = part
            assert cache is not None  # cache hits come from it
            state = chain.state()
            known = entry.chains.get(state)
            if known is not None:
                chain.extend(known[0], known[1], len(entry.data) // ID_BYTES)
                continue
            added = chain.feed(entry.data)
            if added:  # a segment that completes no block is cheaper to hash again
                cache.remember_chain(segment, entry, state, (chain.added(added), chain.state()))
        return chain.tokens, tuple(chain.keys())

    def finish_ids(self, parts: list[IdPart]) -> bytes:
        """The ids of the whole text (`array("I")` bytes), as `finish_keys` reads them."""
        out: list[bytes] = []
        cache = self.cache
        for part in parts:
            if isinstance(part, bytes):
                out.append(part)
            elif isinstance(part, tuple):
                out.append(part[1].data)
            else:
                data = _id_bytes(self._encoded(part))
                if cache is not None and len(part) >= MIN_CACHED_CHARS:
                    cache.put_ids(part, data)
                out.append(data)
        return b"".join(out)

    def ids(self, text: str) -> bytes:
        """The ids of `text` as `encode_rendered` gives them, as `array("I")` bytes."""
        parts, _ = self.plan_ids(text)
        return self.finish_ids(parts)

    def keys(self, text: str, block_tokens: int, scope: str) -> tuple[int, tuple[str, ...]]:
        """The count of `text` and `block_keys` of its ids."""
        parts, _ = self.plan_ids(text)
        return self.finish_keys(parts, block_tokens, scope)

    def _encoded(self, segment: str) -> list[int]:
        try:
            return self._encode(segment)
        except BaseException as exc:
            if is_panic(exc):
                raise CountFailed(f"the tokenizer panicked on a segment of "
                                  f"{len(segment)} characters: {exc}") from exc
            raise
