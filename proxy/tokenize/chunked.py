"""Where long text may be cut into chunks with its ids unchanged, and what its length proves.

A prompt of megabytes costs seconds to encode in one call, and a call in the thread
pool cannot be stopped: counting went on after the client had left, and ran to the
end of a prompt already far past any context (a unique 4 MB prompt: 1.4-1.8 s for a
400). Two such requests held both pool threads for that long.

So a long segment (text between added tokens) is encoded chunk by chunk
(`proxy.tokenize.long_text`), each chunk one pool job of about `CHUNK_CHARS`
characters (~10 ms with the fast encoder):

* between chunks the running count is checked against what could ever be admitted
  (`CountExceeded` as soon as it passes), and a cancelled request stops (the await
  raises; the chunk in flight is its last);
* each chunk joins the pool's queue at its tail, so concurrent long counts take
  turns chunk by chunk and a short count waits behind at most one chunk per thread.

Chunks are cut only where the ids are proven unchanged (`Cuts`), so the sum of the
chunks' counts is the exact count, and the ids joined are the segment's ids.
`floor_tokens` gives a true lower bound from the length alone, so a text that could
never fit is refused before any encoding.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from proxy.tokenize.guard import PATTERNS, WHITESPACE

__all__ = ["CHUNK_CHARS", "CountExceeded", "Cuts", "cuts_for", "floor_tokens"]

# Segments longer than this are counted in chunks of about this size.
CHUNK_CHARS = 65_536

# Split steps before the last one (DeepSeek V3's digits and CJK) whose matches hold no
# whitespace: a cut before whitespace is a piece boundary for them too.
_WHITESPACE_FREE_SPLITS = frozenset({
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
})

_HORIZONTAL = "".join(ch for ch in WHITESPACE if ch not in "\r\n")


class CountExceeded(Exception):
    """Counting stopped: the prompt holds more than `limit` tokens, `at_least` of them
    counted (or proven from its length). No exact figure is claimed beyond that."""

    def __init__(self, at_least: int, limit: int) -> None:
        self.at_least = at_least
        self.limit = limit
        super().__init__(f"at least {at_least} tokens, over the limit of {limit}")


@dataclass(frozen=True, slots=True)
class Cuts:
    """Where a segment may be cut with its ids unchanged, for one split pattern.

    Two kinds of cut, both proven from the pattern's facts (`proxy.tokenize.guard`):

    * before whitespace of the run class (space, tab... and \\r, \\n where the pattern
      has no newline branch) that follows a character that is not whitespace. That
      proof's step 1: no match holding a non-whitespace character reaches into the
      whitespace after it (whitespace stands only first in the letter, digit and
      symbol branches), and nothing in the text before reads past its end more than
      "not a letter, digit, symbol or newline", which the end of text reads the same.
      Step 3: no pattern looks behind or anchors at a start, so the matches from the
      cut on are those of that text alone.
    * after \\n before a letter or digit, where the pattern has a newline branch: every
      branch holds \\r and \\n only among whitespace or in a symbol's tail (`[\\r\\n]*`,
      o200k's `[\\r\\n/]*`, which takes a '/' after the newline: so not before any
      symbol), so a match holding that \\n ends there; at the end of the text before,
      the newline branch (or cl100k's `\\s++$`) takes the same run. Python's letters
      and digits are taken (its Unicode may be older: fewer cuts, never a wrong one).

    NFC (Qwen's normalizer) changes nothing at such a cut: whitespace is a starter that
    composes with nothing before it. tests/test_chunked_counting.py checks both kinds
    against whole-text encoding per bundled tokenizer, at every cut of random texts.
    """

    pattern: re.Pattern[str]

    def next_cut(self, text: str, at: int) -> int | None:
        """The first cut at or after `at` (never 0 or len(text)), or None."""
        m = self.pattern.search(text, max(1, at))
        return None if m is None or m.start() >= len(text) else m.start()


def cuts_for(pattern: str, pre_splits: tuple[str, ...] = ()) -> Cuts | None:
    """The cuts of a split pattern proven to allow them, else None (one chunk)."""
    facts = PATTERNS.get(pattern)
    if facts is None or any(p not in _WHITESPACE_FREE_SPLITS for p in pre_splits):
        return None
    ws = re.escape(WHITESPACE)
    run = re.escape(_HORIZONTAL if facts.newline_branch else WHITESPACE)
    kinds = [f"(?<=[^{ws}])(?=[{run}])"]
    if facts.newline_branch:
        kinds.append("(?<=\\n)(?=[^\\W_])")  # a letter or digit (Python's, a subset)
    return Cuts(re.compile("|".join(kinds)))


def floor_tokens(text: str, *, longest_token_chars: int, nfc: bool) -> int:
    """A true lower bound on the tokens of `text`, from its length alone.

    Byte-level BPE: every id of a segment covers at most `longest_token_chars` bytes
    (the vocab's longest entry), so ids >= bytes / longest >= characters / longest; an
    added token is one id for its whole text, so `longest_token_chars` covers the
    longest added token too. NFC may shorten
    non-ASCII text, at most four code points into one (the longest canonical
    decomposition), so such text is divided by four times more.
    """
    per_id = longest_token_chars * (4 if nfc and not text.isascii() else 1)
    return -(-len(text) // per_id)

