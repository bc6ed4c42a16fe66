"""Counting that survives hostile text: long runs that break the regex, and panics.

tiktoken's Rust core (the fast byte-level path, tiktoken encodings, Mistral's tekken)
splits text with fancy-regex, whose backtracking VM has two limits, and
`encode_ordinary` unwraps the error: a Rust panic, raised in Python as
`pyo3_runtime.PanicException`, which derives from `BaseException` and so passes every
`except Exception` (`encode` raises `ValueError` instead). Measured with tiktoken
0.14.0, on the core's own `encode_ordinary`:

* its stack: the `\\s+(?!\\S)` branch of every bundled pattern (Qwen3, gpt-oss and
  o200k, DeepSeek V3, cl100k, tekken) pushes a frame per character. A run of 999,998
  whitespace characters encodes, 999,999 fails: space, tab, NBSP, U+3000, U+2003, VT,
  NEL, or mixed. Runs of newlines, and 1.2M characters of '!', '-', a digit, one
  emoji, a combining mark or a letter, never fail: those branches are delegated to the
  linear-time `regex` crate.
* its backtracks: a pattern that does not match at every position (DeepSeek V3's)
  leaves gaps, which the fast path keeps as pieces with a catch-all branch; 166,665
  characters of U+0001, U+200B or U+E000 in a row fail there (`gap_runs`).

So counting never hands the core a run of `LONG_RUN` such characters:

* `whitespace_runs` and `gap_runs` are the pre-checks: free for text shorter than
  `LONG_RUN`, a few dozen lookups per megabyte otherwise;
* `RunCutter` encodes text with a long whitespace run exactly, for the split patterns
  proven to allow it (`PATTERNS`): the run becomes one piece encoded by BPE alone
  (`encode_single_piece`), the text around it goes through the core as before;
* what no cutter takes is counted by `tokenizers` (the fast byte-level path's
  reference), and every count path catches what a tokenizer library still raises,
  panics included (`is_panic`): the reference counts instead or, where nothing can,
  `CountFailed` says so.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from proxy.tokenize.low_priority import run_low_priority

__all__ = ["CORE_RUN", "LONG_RUN", "PATTERNS", "WHITESPACE", "CountFailed", "PatternFacts",
           "RunCheck", "RunCutter", "gap_runs", "is_library_failure", "is_panic",
           "whitespace_runs"]


class CountFailed(Exception):
    """No tokenizer could count this text exactly; no count is guessed.

    Raised by every count path (`count_chat`, `count_prompt`, their `_async` variants,
    `count_rendered_async`) where the tokenizer library failed (a Rust panic, a regex
    engine's limit) and no exact path was left to count with. The HTTP layer answers
    it as `500 internal_error` naming the request id (an `Exception`, so the error
    middleware's last resort maps it so), and logs this message with the request id:
    it names the tokenizer and the library's error, never the prompt's text. Count
    workers report it as `{"count_failed": message}` and the proxy raises it again.
    """


def is_panic(exc: BaseException) -> bool:
    """A Rust panic surfaced by PyO3 (`pyo3_runtime.PanicException`, a `BaseException`).

    Each PyO3 extension (tiktoken, tokenizers) has its own class of that name, so it
    is recognised by name and module; KeyboardInterrupt, SystemExit, GeneratorExit and
    asyncio.CancelledError are never panics.
    """
    return any(cls.__name__ == "PanicException" and cls.__module__ == "pyo3_runtime"
               for cls in type(exc).__mro__)


def is_library_failure(exc: BaseException) -> bool:
    """What a tokenizer library may raise on text: any `Exception`, or a Rust panic."""
    return isinstance(exc, Exception) or is_panic(exc)


# Unicode White_Space: what `\s` means to the Rust `regex` crate (and fancy-regex). Not
# Python's `\s`, which adds U+001C..U+001F: those are symbols to tiktoken's patterns.
# tests/test_hostile_counting.py checks this set against tiktoken's own core.
WHITESPACE = ("\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
              "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")
_HORIZONTAL = "".join(ch for ch in WHITESPACE if ch not in "\r\n")

# Runs this long never reach tiktoken's core: a fifteenth of the whitespace limit, and
# under half of DeepSeek V3's gap limit (166,665, see `gap_runs`). Every run this long
# is found; runs of more than half of it may be reported too.
LONG_RUN = 65_536
_STEP = LONG_RUN // 2
# A run alone this long still passes the core's regex (999,998 do), with room to spare.
CORE_RUN = 8 * LONG_RUN


class RunCheck:
    """Finds runs of `LONG_RUN` or more characters of one class, cheaply.

    A run that long covers two consecutive multiples of `LONG_RUN // 2`, so only those
    positions are looked at, and only where both hold the class is the text between
    them scanned; a run reported is longer than `LONG_RUN // 2`. Free for text shorter
    than `LONG_RUN` (nearly every prompt), O(len / LONG_RUN) lookups for other text,
    never more than one scan of it.
    """

    def __init__(self, char_class: str) -> None:
        """`char_class`: the inside of a regex `[...]`, already escaped."""
        self._one = re.compile(f"[{char_class}]").match
        self._span = re.compile(f"[{char_class}]*").match

    def __call__(self, text: str) -> bool:
        n = len(text)
        if n < LONG_RUN:
            return False
        one, span, step = self._one, self._span, _STEP
        for i in range(0, n - step, step):
            if one(text, i) is not None and one(text, i + step) is not None:
                m = span(text, i)
                if m is not None and m.end() > i + step:
                    return True
        return False


whitespace_runs = RunCheck(re.escape(WHITESPACE))

_gap_runs: RunCheck | None = None


def gap_runs() -> RunCheck:
    r"""Runs of characters that are neither letters, marks, punctuation, symbols nor
    whitespace (Python's general categories C* and N*: controls, format characters
    such as U+200B, private use, unassigned code points, numbers).

    A pattern that does not match at every position (DeepSeek V3's: a control or
    format character before no letter) leaves gaps, which the fast path keeps as
    pieces with a catch-all branch `(?:(?!(?:pattern))[\s\S])+`; the VM tries every
    branch at each of its characters and stops at a million backtracks: 166,665
    characters of U+0001, U+200B or U+E000 in a row for DeepSeek V3. Python's older
    Unicode tables call a character assigned since then unassigned (C): it is checked
    too, which only routes more text to the exact path. Built on first use (~0.5 s).
    """
    global _gap_runs
    if _gap_runs is None:
        import unicodedata

        ranges: list[str] = []
        start: int | None = None
        for cp in range(0x110001):
            gap = (cp < 0x110000 and unicodedata.category(chr(cp))[0] in "CN"
                   and chr(cp) not in WHITESPACE)
            if gap and start is None:
                start = cp
            elif not gap and start is not None:
                ranges.append(f"{re.escape(chr(start))}-{re.escape(chr(cp - 1))}")
                start = None
        _gap_runs = RunCheck("".join(ranges))
    return _gap_runs


@dataclass(frozen=True, slots=True)
class PatternFacts:
    """What the proof below needs of a split pattern, read off it by hand."""

    newline_branch: bool  # \r and \n have a branch of their own (`\s*[\r\n]+`)
    total: bool  # some branch matches at every position: no gaps


# Split patterns for which cutting a long whitespace run out is proven exact.
#
# The proof, for text = P + R + S, R a maximal run (length >= 2) of the run class
# (whitespace but \r and \n where the pattern has a newline branch, all whitespace
# otherwise) and S empty or starting with a character that is not whitespace:
# 1. No match that holds the character before R reaches into R. That character is not
#    whitespace, or it is \r or \n (then the pattern has a newline branch); the letter,
#    digit, contraction and symbol branches hold whitespace only as their optional
#    first character (`[^\r\n\p{L}\p{N}]?`, ` ?`), the newline branches end at \r or \n
#    and come before `\s+(?!\S)`, and a catch-all gap stops where the pattern matches,
#    as it does at R's start (2.). So a match ends where R starts, and P alone is split
#    as in the whole text: no match of P reads more of R than "not a letter, digit,
#    symbol or newline", which the end of the text reads the same; where P ends in
#    whitespace ending in a newline, cl100k's `\s++$` (before `\s*[\r\n]`) takes
#    alone what `\s*[\r\n]` takes in the whole text.
# 2. At R's start every branch before the whitespace ones needs a letter, digit or
#    symbol at R's first or second character and fails; R holds no \r or \n, so the
#    newline branch fails; `\s++$` or `\s+(?!\S)` takes R whole at the end of the
#    text, and R less its last character before S.
# 3. No pattern here looks behind or anchors at a start (`^`, `\A`, `\b`, `\G`), and
#    none matches the empty string, so the matches from R's last character on are those
#    of that text alone.
# BPE runs per match, so ids = core(P) + bpe(R[:-1]) + core(R[-1] + S), and
# ids = core(P) + bpe(R) at the end of the text. tests/test_hostile_counting.py checks
# it against the core itself on runs it can take, cut at any length.
PATTERNS: dict[str, PatternFacts] = {
    # Qwen2, Qwen2.5, Qwen3 tokenizer.json
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+": PatternFacts(newline_branch=True, total=True),
    # Llama 3 tokenizer.json
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        PatternFacts(newline_branch=True, total=True),
    # o200k_base, o200k_harmony (tiktoken), gpt-oss tokenizer.json
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        PatternFacts(newline_branch=True, total=True),
    # Mistral tekken (Nemo's tekken.json)
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        PatternFacts(newline_branch=True, total=True),
    # cl100k_base (tiktoken)
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+"""
    r"""| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""":
        PatternFacts(newline_branch=True, total=True),
    # r50k_base, p50k_base, p50k_edit, gpt2 (tiktoken)
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s""":
        PatternFacts(newline_branch=False, total=True),
    # DeepSeek V3 and R1 tokenizer.json, the last Split (digits and CJK are split before);
    # a control or format character before no letter is a gap
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
    "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+":
        PatternFacts(newline_branch=True, total=False),
}


class RunCutter:
    """tiktoken's core on text with whitespace runs of any length, for one of `PATTERNS`.

    `encode_ordinary` is the core's (text -> ids, no special tokens); `encode_piece` is
    BPE of one piece's bytes without the regex (`CoreBPE.encode_single_piece`). Runs of
    more than `LONG_RUN // 2` characters of the run class that end the text or stand
    before a character that is not whitespace are cut out as the proof above allows;
    a run before \r or \n is left in: the delegated newline branch takes it whole.
    `min_run` is for the tests, which cut runs of any length to check the proof.
    """

    def __init__(self, pattern: str, *, encode_ordinary: Callable[[str], list[int]],
                 encode_piece: Callable[[bytes], list[int]], min_run: int = _STEP,
                 encode_long_run: Callable[[str], list[int]] | None = None) -> None:
        """`encode_long_run`: BPE of a run too long for the core's regex, without the
        GIL (`tokenizers`' `encode_batch` releases it, and tiktoken's core given bytes
        that are not text, `encoders.gil_free_piece`; `encode_single_piece` does not:
        4 MB of spaces held every other thread for 2.5-3.4 s); `encode_piece`
        otherwise."""
        facts = PATTERNS[pattern]
        cls = re.escape(_HORIZONTAL if facts.newline_branch else WHITESPACE)
        # Anchored at a run's start, so each run is scanned once, not from each character.
        self._runs = re.compile(f"(?<![{cls}])[{cls}]{{{max(2, min_run)},}}")
        self._encode = encode_ordinary
        self._piece = encode_piece
        self._long_run = encode_long_run

    def _run(self, run: str) -> list[int]:
        """BPE of one run, as one piece. Up to `CORE_RUN` characters through the core's
        own regex, which releases the GIL: a run of the run class alone is one match
        there (no branch before the whitespace ones matches at its start, and
        `\\s++$` or `\\s+(?!\\S)` takes it whole at the end of the text). Calls that
        release the GIL run at the lowest priority (`proxy.tokenize.low_priority`):
        one is up to seconds of a core that no cut can shorten."""
        if len(run) <= CORE_RUN:
            return run_low_priority(self._encode, run)
        if self._long_run is not None:
            return run_low_priority(self._long_run, run)
        return self._piece(run.encode("utf-8"))

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        pos = 0
        n = len(text)
        for m in self._runs.finditer(text):
            start, end = m.span()
            if end < n:
                if text[end] in "\r\n":
                    continue  # one match of the newline branch with what follows
                end -= 1  # the run's last character goes with what follows it
            if start > pos:
                ids += self._encode(text[pos:start])
            ids += self._run(text[start:end])
            pos = end
        if pos < n:
            ids += self._encode(text[pos:])
        return ids
