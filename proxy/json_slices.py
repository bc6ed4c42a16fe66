"""`json.loads` for a large body, in short C calls: the same value and the same errors.

`json.loads` is one C call that holds the GIL until the whole text is parsed: 40 to
65 ms for 4 MB of a million small values, during which no other thread (the event
loop included) runs, wherever the parse itself runs. `loads_sliced` walks the large
containers in Python and hands the C scanner pieces of at most about `WINDOW`
characters, so the interpreter can switch threads between pieces:

- a container or string that fits a window is scanned whole;
- a longer container is walked one level down (no deeper than `max_depth`, past
  which `TooDeep`: the caller refuses such nesting anyway), its members scanned in
  runs: the text up to the last comma of a window, wrapped in the container's
  brackets, is scanned as one container. That is the run of members before that
  comma exactly when the scan takes all of it (a comma inside a string or a nested
  container leaves the wrapped text unterminated or unbalanced); else its members
  are scanned one by one;
- one long string or number is read in one call, at memory speed.

The result is the value `json.loads` gives, and a malformed text raises the
`JSONDecodeError` it raises, with its message and position (CPython 3.11's scanner):
a failed scan of a window or a run only sends the walk down the exact path.
"""

from __future__ import annotations

import json
import json.scanner
import re
from collections.abc import Callable
from dataclasses import dataclass
from json import JSONDecodeError
from typing import Any

__all__ = ["WINDOW", "TooDeep", "loads_sliced"]

WINDOW = 1 << 16
"""Characters the C scanner reads in one call (at most a fraction of a millisecond)."""

_WS = re.compile(r"[ \t\n\r]*")
_OPENERS = frozenset("[{")
_RUN_TRIES = 8  # commas tried, from a window's last back, for a run's end
_RUN_MEMBER_CHARS = 256  # members scanned in runs while their mean length is below


class TooDeep(ValueError):
    """Containers that do not fit a window nest deeper than the limit."""


class _Slicer:
    def __init__(self, text: str, decoder: json.JSONDecoder, max_depth: int) -> None:
        self.text = text
        # what `decoder.scan_once` is (typeshed types its argument oddly)
        self.scan: Callable[[str, int], tuple[Any, int]] = json.scanner.make_scanner(
            decoder)  # type: ignore[arg-type]
        self.max_depth = max_depth
        self.win_at = 0
        self.win = ""

    def ws(self, i: int) -> int:
        end = _WS.match(self.text, i)
        assert end is not None  # the pattern matches the empty string
        return end.end()

    def scan_full(self, i: int) -> tuple[Any, int]:
        """One scalar (or a container, parsed whole) at `i` of the full text."""
        try:
            return self.scan(self.text, i)
        except StopIteration as exc:
            raise JSONDecodeError("Expecting value", self.text, exc.value) from None

    def in_window(self, i: int) -> tuple[Any, int] | None:
        """The container or string at `i` if it ends inside a window from `i`; else
        None (it is longer, or malformed: the caller finds out which, exactly)."""
        win_end = self.win_at + len(self.win)
        if i < self.win_at or (i + WINDOW // 2 > win_end and win_end < len(self.text)):
            self.win_at, self.win = i, self.text[i:i + WINDOW]
        try:
            value, end = self.scan(self.win, i - self.win_at)
        except (StopIteration, ValueError, RecursionError):
            return None
        return value, end + self.win_at

    def run(self, i: int, brackets: str) -> tuple[Any, int] | None:
        """Members from `i` to a comma late in a window (the last, else one of the few
        before it: the container may end inside the window, or the comma be a
        member's own), as one container, and the index after that comma; None where
        no such run scans whole."""
        text = self.text
        cut = min(i + WINDOW, len(text))
        for _ in range(_RUN_TRIES):
            cut = text.rfind(",", i, cut)
            if cut <= i:
                return None
            piece = brackets[0] + text[i:cut] + brackets[1]
            try:
                value, end = self.scan(piece, 0)
            except (StopIteration, ValueError, RecursionError):
                continue
            if end == len(piece):
                return value, cut + 1
        return None

    def members(self, i: int, brackets: str, depth: int,
                one: Callable[[int, int], tuple[Any, int]]) -> tuple[list[Any], int]:
        """The members of a container too long for a window, from its first (at `i`)
        to past its closing bracket: in runs while members are small, else one by one
        (`one(i, depth)` -> (member, end)). -> (runs and members in order, end)."""
        text, out, size = self.text, [], 0.0
        # After a failed run, members one by one for a stretch that doubles with each
        # failure in a row: members whose own commas fill every window's end (runs
        # never scan whole) cost a few failed windows, not one per member.
        retry_at, stretch = i, WINDOW // 4
        while True:
            if size < _RUN_MEMBER_CHARS and i >= retry_at:
                got = self.run(i, brackets)
                if got is not None:
                    out.append(got[0])
                    i = self.ws(got[1])
                    stretch = WINDOW // 4
                    continue
                retry_at, stretch = i + stretch, stretch * 2
            start = i
            member, i = one(i, depth)
            out.append(member)
            size = (size * 7 + (i - start)) / 8
            i = self.ws(i)
            char = text[i:i + 1]
            if char == brackets[1]:
                return out, i + 1
            if char != ",":
                raise JSONDecodeError("Expecting ',' delimiter", text, i)
            i = self.ws(i + 1)

    def value(self, i: int, depth: int) -> tuple[Any, int]:
        char = self.text[i:i + 1]
        if char in _OPENERS and char:
            got = self.in_window(i)
            if got is not None:
                return got
            if depth >= self.max_depth:
                raise TooDeep(f"containers nest deeper than {self.max_depth} levels")
            return self.array(i, depth + 1) if char == "[" else self.obj(i, depth + 1)
        if char == '"':
            got = self.in_window(i)
            if got is not None:
                return got
        return self.scan_full(i)

    def array(self, i: int, depth: int) -> tuple[list[Any], int]:
        i = self.ws(i + 1)
        if self.text[i:i + 1] == "]":
            return [], i + 1
        parts, end = self.members(i, "[]", depth, self.one_item)
        out: list[Any] = []
        for part in parts:
            if isinstance(part, _Item):
                out.append(part.value)
            else:
                out += part
        return out, end

    def one_item(self, i: int, depth: int) -> tuple[_Item, int]:
        value, end = self.value(i, depth)
        return _Item(value), end

    def obj(self, i: int, depth: int) -> tuple[dict[str, Any], int]:
        i = self.ws(i + 1)
        if self.text[i:i + 1] == "}":
            return {}, i + 1
        parts, end = self.members(i, "{}", depth, self.pair)
        out: dict[str, Any] = {}
        for part in parts:  # a run's dict, or one (key, value)
            if isinstance(part, dict):
                out.update(part)
            else:
                out[part[0]] = part[1]
        return out, end

    def pair(self, i: int, depth: int) -> tuple[tuple[str, Any], int]:
        text = self.text
        if text[i:i + 1] != '"':
            raise JSONDecodeError("Expecting property name enclosed in double quotes", text, i)
        key, i = self.value(i, depth)
        i = self.ws(i)
        if text[i:i + 1] != ":":
            raise JSONDecodeError("Expecting ':' delimiter", text, i)
        value, i = self.value(self.ws(i + 1), depth)
        return (key, value), i


@dataclass(slots=True)
class _Item:
    """One array member scanned alone (a run is a plain list: never confused)."""

    value: Any


def loads_sliced(text: str, decoder: json.JSONDecoder, *, max_depth: int) -> Any:
    """`decoder.decode(text)`, with no C call reading more than about `WINDOW`
    characters of containers (one long string or number is read in one call)."""
    if text.startswith("\ufeff"):
        raise JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    slicer = _Slicer(text, decoder, max_depth)
    value, end = slicer.value(slicer.ws(0), 0)
    end = slicer.ws(end)
    if end != len(text):
        raise JSONDecodeError("Extra data", text, end)
    return value
