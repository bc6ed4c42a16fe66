"""Exact byte-level BPE at tiktoken's speed, for tokenizers proven to agree.

Qwen2/3, Llama 3 and DeepSeek-style `tokenizer.json` files are byte-level BPE: a
regex splits text into pieces, each piece's UTF-8 bytes are merged pairwise. That
is what tiktoken's Rust core does too, about eight times faster than `tokenizers`
on the same text (0.145 ms vs 1.17 ms for 1,000 Qwen3 tokens; DeepSeek V3, whose
first splits run in Python, about three to four times). The two agree only when:

* the normalizer is absent or NFC (applied here per segment, by the reference's own
  normalizer, so both follow the same Unicode version);
* the pre-tokenizer is `Split(regex, Isolated)` steps + `ByteLevel(use_regex=False)`:
  the last regex becomes tiktoken's `pat_str`; earlier ones (DeepSeek V3 splits
  digit groups and CJK runs first) run in Python with the `regex` package, and
  must not use shorthand classes (`\\s`, `\\w`, `\\d`, `\\b`) whose meaning differs
  between regex engines;
* the model is plain BPE (no dropout, no byte fallback, no word prefixes/suffixes)
  whose vocab maps back to bytes through GPT-2's byte-to-unicode table, with all
  256 single bytes present;
* tiktoken merges the pair whose *merged piece* has the lowest rank (vocab id);
  `tokenizers` merges the pair that comes first in `merges`. Same order only when
  the merged pieces' ids never decrease along `merges` (checked);
* tiktoken takes a piece that is itself in the vocab as one token; `tokenizers`
  does so only with `ignore_merges`, otherwise it merges: same result only when
  every vocab entry merges back to itself (checked, against `tokenizers`' own model).

Structure is necessary, not sufficient, so a model takes this path only after it
also encodes a built-in probe set (scripts, emoji, combining marks, whitespace
runs, digits, CRLF, special-token text) exactly as `tokenizers` does. Anything
else keeps `tokenizers`; `kvgate check-config` says which path each model takes.
`KVGATE_FAST_BPE=0` forces `tokenizers` everywhere.

Text that would break the core's regex (a run of a million spaces makes it panic,
`proxy.tokenize.guard`) never reaches it: a long whitespace run is cut out where the
pattern is proven to allow it, and anything else of that kind, or anything the core
still raises, is counted by `tokenizers`, exactly.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.tokenize.chunked import Cuts, cuts_for, floor_tokens
from proxy.tokenize.encoders import HFEncoder, SpecialSplitter
from proxy.tokenize.guard import (
    LONG_RUN,
    PATTERNS,
    RunCutter,
    gap_runs,
    is_library_failure,
    whitespace_runs,
)

__all__ = ["ByteLevelBPEEncoder", "FastPlan", "fast_bpe_enabled", "plan_fast_bpe", "try_fast"]

ENV_SWITCH = "KVGATE_FAST_BPE"

log = logging.getLogger("kvgate")

# Text the fast path must encode exactly as `tokenizers` before it is used.
PROBES: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog. It's 3.14159, isn't it? I'd've said 42!",
    "数学 ∑ x² 🌅 naïve café 東京 👩\u200d💻 안녕하세요 مرحبا שלום Привет, мир! ελληνικά हिन्दी",
    "e\u0301a\u0308o\u0302 combining marks, A\u030a and \u212b, Ǆ ǅ ǆ, ﬁ ligature, ½ ¹",
    "line one\nline two\n\n\ttabbed\r\nCRLF\r\n\r\n   three spaces   \n \n\n\n  end  ",
    "1234567890 12 345 6789 0.5e-10 ١٢٣ ４５６ 0x1F 1,000,000 v1.2.3",
    "def f(x):\n    return {'a': [1, 2]}  # comment\n\tif x >= 0 && y != 1: pass",
    "😀😃😄 🏳️\u200d🌈 🇫🇷🇯🇵 \U0001f9d1\U0001f3fd\u200d\U0001f680 ❤️ ⌚ \u2060\u200b\ufeff",
    "              many spaces                      then text",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "<|endoftext|><tool_call>{\"name\": \"x\"}</tool_call> <|im_end|>x <｜User｜>y",
    "'S 'T 'RE 'VE 'M 'LL 'D  's 't 're 've 'm 'll 'd HELLO's don't",
    "tab\tend\\n `code` {json: 1} <tag> π≈3.14159 ∞ ≠ ≤ ≥ → ← ↔ ™ © ®",
    "\u00a0nbsp\u2003em\u3000ideographic\u2028line\u2029para\x0bvt\x0cff\x1fus\x7fdel",
    "x" * 600 + " " + "ab" * 300 + " " + "\n" * 50 + "-" * 120 + "=" * 77 + "🙂" * 40,
    "ﾊﾟﾋﾟﾌﾟ がぎぐ ガギグ 가각 ā́ ǘ ṩ ẛ̣ Åström Ωmega K",
)


def _compile_split(pattern: str) -> Any:
    """`regex` (not `re`) for the Split steps Python runs: it knows `\\p{N}`, `\\p{L}`."""
    import regex

    return regex.compile(pattern)


_unassigned: re.Pattern[str] | None = None


def _unassigned_chars() -> re.Pattern[str]:
    """Characters Python's Unicode tables do not assign (3.11: Unicode 14.0).

    The `regex` package follows a newer Unicode than Oniguruma: digits added since
    (U+11DE0..U+11DE9) are `\\p{N}` to one and nothing to the other. Text with a
    character this old table does not know is left to `tokenizers`.
    """
    global _unassigned
    if _unassigned is None:
        import unicodedata

        ranges: list[str] = []
        start = None
        for cp in range(0x110001):
            unassigned = cp < 0x110000 and unicodedata.category(chr(cp)) == "Cn"
            if unassigned and start is None:
                start = cp
            elif not unassigned and start is not None:
                ranges.append(f"{re.escape(chr(start))}-{re.escape(chr(cp - 1))}")
                start = None
        _unassigned = re.compile(f"[{''.join(ranges)}]")
    return _unassigned


def fast_bpe_enabled() -> bool:
    """On unless `KVGATE_FAST_BPE` is 0/false/no/off (then `tokenizers` is used)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable stand-in char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shift = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shift)] = b
            shift += 1
    return table


@dataclass(frozen=True, slots=True)
class FastPlan:
    """What tiktoken's core needs, derived from one `tokenizer.json`."""

    pat_str: str
    pattern: str  # the last Split regex, as `pat_str` has it before kvgate's catch-all
    pre_splits: tuple[str, ...]  # earlier Split regexes, run in Python before the core
    ranks: dict[bytes, int]
    nfc: bool
    plain_adds_tokens: bool  # the post-processor adds tokens to plain prompts


def _is_nfc_or_none(normalizer: Any) -> tuple[bool, bool]:
    """-> (acceptable, applies NFC)."""
    if normalizer is None:
        return True, False
    kind = normalizer.get("type")
    if kind == "NFC":
        return True, True
    if kind == "Sequence":
        inner = normalizer.get("normalizers") or []
        if not inner:
            return True, False
        if len(inner) == 1:
            return _is_nfc_or_none(inner[0])
    return False, False


# Shorthand classes whose meaning differs between regex engines (Python's `\s` takes
# \x1c-\x1f, Oniguruma's does not): refused in the splits Python runs itself.
_ENGINE_DEPENDENT = re.compile(r"(?<!\\)(?:\\\\)*\\[sSwWdDbB]")


def _split_regexes(pre: Any) -> list[str] | None:
    """The regexes of `Sequence[Split(Regex, Isolated)..., ByteLevel(use_regex=False)]`."""
    if not isinstance(pre, Mapping) or pre.get("type") != "Sequence":
        return None
    steps = list(pre.get("pretokenizers") or [])
    if len(steps) < 2:
        return None
    byte_level = steps.pop()
    if (byte_level.get("type") != "ByteLevel" or byte_level.get("use_regex", True)
            or byte_level.get("add_prefix_space")):
        return None
    patterns: list[str] = []
    for split in steps:
        if (split.get("type") != "Split" or split.get("behavior") != "Isolated"
                or split.get("invert") or "Regex" not in (split.get("pattern") or {})):
            return None
        patterns.append(split["pattern"]["Regex"])
    if any(_ENGINE_DEPENDENT.search(p) for p in patterns[:-1]):
        return None
    return patterns


def _post_adds_tokens(post: Any) -> bool:
    if post is None or post.get("type") == "ByteLevel":
        return False
    if post.get("type") == "Sequence":
        return any(_post_adds_tokens(p) for p in post.get("processors") or [])
    return True


def plan_fast_bpe(tokenizer_json: Mapping[str, Any],
                  added: Mapping[str, int] | None) -> FastPlan | str:
    """A plan for tiktoken's core, or the reason this tokenizer keeps `tokenizers`."""
    if added is None:
        return "an added token strips whitespace, is single-word, or is matched normalized"
    nfc_ok, nfc = _is_nfc_or_none(tokenizer_json.get("normalizer"))
    if not nfc_ok:
        return f"normalizer {tokenizer_json.get('normalizer', {}).get('type')!r} is not NFC"
    patterns = _split_regexes(tokenizer_json.get("pre_tokenizer"))
    if patterns is None:
        return "pre-tokenizer is not Split(regex)... + ByteLevel(use_regex=False)"
    *pre_splits, pattern = patterns
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE":
        return f"model type {model.get('type')!r} is not BPE"
    if model.get("dropout") or model.get("byte_fallback"):
        return "BPE dropout or byte fallback"
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return "BPE with subword prefixes or word suffixes"
    to_byte = _unicode_to_byte()
    vocab: Mapping[str, int] = model.get("vocab") or {}
    ranks: dict[bytes, int] = {}
    for token, token_id in vocab.items():
        try:
            ranks[bytes(to_byte[ch] for ch in token)] = token_id
        except KeyError:
            if token in added:
                continue  # reachable only as an added token, which is split out first
            return f"vocab entry {token!r} is not byte-level"
    if len(ranks) != len(set(ranks.values())):
        return "two vocab entries share bytes or an id"
    if any(bytes([b]) not in ranks for b in range(256)):
        return "not all 256 single bytes are in the vocab"
    previous = -1
    for merge in model.get("merges") or []:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        merged = vocab.get(left + right)
        if merged is None:
            return f"merge {left!r} + {right!r} makes a token not in the vocab"
        if merged < previous:
            return "merge order and vocab ids disagree (tiktoken merges by id)"
        previous = merged
    # A catch-all for text the regex does not match: `Split(Isolated)` keeps such
    # gaps as pieces, tiktoken would drop them. Never reached for total patterns.
    pat_str = f"{pattern}|(?:(?!(?:{pattern}))[\\s\\S])+"
    return FastPlan(pat_str=pat_str, pattern=pattern, pre_splits=tuple(pre_splits),
                    ranks=ranks, nfc=nfc,
                    plain_adds_tokens=_post_adds_tokens(tokenizer_json.get("post_processor")))


def _vocab_merges_to_itself(reference: HFEncoder, tokenizer_json: Mapping[str, Any]) -> bool:
    """Without `ignore_merges`, a whole-vocab piece is still merged pair by pair."""
    model = tokenizer_json["model"]
    if model.get("ignore_merges"):
        return True
    bpe = reference.tokenizer.model
    added = reference.added_tokens or {}
    return all(
        len(pieces := bpe.tokenize(token)) == 1 and pieces[0].value == token
        for token in model["vocab"]
        if token not in added  # split out before the model sees text
    )


class _ToReference(Exception):
    """A piece the core must not be given and no cutter takes: `tokenizers` counts."""


class ByteLevelBPEEncoder:
    """tiktoken's BPE core on a `tokenizer.json` vocab, with `tokenizers`' added-token split.

    Falls back to the reference for text the core cannot take (lone surrogates, runs
    that break its regex, anything it raises), so errors stay those of `tokenizers`.
    """

    def __init__(self, *, reference: HFEncoder, core: Any, plan: FastPlan,
                 splitter: SpecialSplitter) -> None:
        self._ref = reference
        # The core itself, not `Encoding.encode_ordinary`: that public wrapper catches
        # UnicodeEncodeError and re-encodes lone surrogates as U+FFFD, ids `tokenizers`
        # does not give; here the error reaches `encode_segment`, which asks the
        # reference (tests/test_fast_bpe.py checks it on surrogates).
        self._core_encode = core._core_bpe.encode_ordinary
        # Pieces of `LONG_RUN` characters or more are checked first (`_long`).
        facts = PATTERNS.get(plan.pattern)
        self._cutter = None if facts is None else RunCutter(
            plan.pattern, encode_ordinary=self._core_encode,
            encode_piece=core._core_bpe.encode_single_piece,
            encode_long_run=self._reference_run)
        self._check_gaps = facts is None or not facts.total
        if self._check_gaps:
            gap_runs()  # built once (~0.3 s), at load rather than on a request
        self._pre_splits = [_compile_split(p) for p in plan.pre_splits]
        self._unassigned = _unassigned_chars() if self._pre_splits else None
        # NFC through the reference's own normalizer: Python's unicodedata follows
        # another Unicode version (3.11: 14.0), and a combining class it knows and
        # `tokenizers` does not reorders marks differently ("A\u1dd9\u1ac0").
        self._normalize = reference.tokenizer.normalizer.normalize_str if plan.nfc else None
        self._plain_adds_tokens = plan.plain_adds_tokens
        self.splitter = splitter
        self.cuts: Cuts | None = cuts_for(plan.pattern, plan.pre_splits)
        self._longest = max(max(map(len, plan.ranks), default=1), splitter.longest)
        self._nfc = plan.nfc
        self.description = "fast byte-level BPE (tiktoken core), checked against tokenizers"
        self.bound_description = ("UTF-8 bytes of the rendered chat"
                                  + (", ASCII text only (NFC)" if plan.nfc else ""))
        self.fast = True

    def encode_segment(self, text: str) -> list[int]:
        original = text
        try:
            if self._normalize is not None and not text.isascii():
                text = self._normalize(text)  # NFC is idempotent: the reference may redo it
            if not self._pre_splits:
                if len(text) < LONG_RUN:
                    ids: list[int] = self._core_encode(text)
                    return ids
                return self._long(text)
            if (self._unassigned is not None and not text.isascii()
                    and self._unassigned.search(text)):
                return self._ref.encode_segment(text)
            ids = []
            core = self._core_encode
            for piece in self._pieces(text):
                ids += core(piece) if len(piece) < LONG_RUN else self._long(piece)
            return ids
        except UnicodeEncodeError:  # lone surrogates: whatever `tokenizers` does with them
            return self._ref.encode_segment(original)
        except _ToReference:
            return self._ref.encode_segment(original)
        except BaseException as exc:
            # The safety net: a panic (a BaseException) or an error from the core on text
            # no pre-check foresaw; KeyboardInterrupt, CancelledError and the like pass.
            if not is_library_failure(exc):
                raise
            log.warning("the fast byte-level path failed on a segment of %d characters "
                        "(%s: %s); counting it with tokenizers", len(original),
                        type(exc).__name__, exc)
            return self._ref.encode_segment(original)

    def _reference_run(self, run: str) -> list[int]:
        """A whitespace run too long for the core's regex, by the reference in a call
        that releases the GIL (one piece there too: the same pattern; NFC leaves
        whitespace alone). The cutter runs it at the lowest priority."""
        ids: list[int] = self._ref.tokenizer.encode_batch([run], False)[0].ids
        return ids

    def _long(self, piece: str) -> list[int]:
        """A piece of `LONG_RUN` characters or more, for the core: a long whitespace run
        is cut out where the pattern allows it; a run no cutter takes, and a long gap
        (`gap_runs`, patterns that do not match everywhere), go to the reference."""
        if self._check_gaps and gap_runs()(piece):
            raise _ToReference
        if whitespace_runs(piece):
            if self._cutter is None:
                raise _ToReference
            return self._cutter.encode(piece)
        ids: list[int] = self._core_encode(piece)
        return ids

    def _pieces(self, text: str) -> list[str]:
        """`Split(Isolated)` steps before the last: matches and the gaps between them
        both become pieces, and each step splits every piece of the one before."""
        pieces = [text]
        for pattern in self._pre_splits:
            out: list[str] = []
            for piece in pieces:
                pos = 0
                for m in pattern.finditer(piece):
                    start, end = m.span()
                    if start > pos:
                        out.append(piece[pos:start])
                    if end > start:
                        out.append(piece[start:end])
                    pos = end
                if pos < len(piece):
                    out.append(piece[pos:])
            pieces = out
        return pieces

    def split_rendered(self, text: str) -> list[str | int]:
        return self.splitter.split(text)

    def max_rendered_tokens(self, text: str) -> int | None:
        """UTF-8 bytes: each byte-level token covers at least one byte of its segment and
        each added token is one id for a text of one or more bytes. NFC may lengthen
        non-ASCII text (U+0958 becomes two code points, 3 bytes become 6), so with an
        NFC normalizer only ASCII text is bounded; NFC leaves ASCII unchanged."""
        if self._normalize is None or text.isascii():
            return len(text.encode("utf-8", "surrogatepass"))
        return None

    def min_rendered_tokens(self, text: str) -> int:
        """`floor_tokens`: the vocab's longest entry, or added token, per id."""
        return floor_tokens(text, longest_token_chars=self._longest, nfc=self._nfc)

    def encode_rendered(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in self.splitter.split(text):
            if isinstance(part, int):
                ids.append(part)
            else:
                ids += self.encode_segment(part)
        return ids

    def plain_parts(self, text: str) -> tuple[list[str | int], int | None] | None:
        """`encode_plain(text, add_special_tokens=True)` as parts to encode in turn and
        the BOS id put first where the first id is not it; None where the reference's
        post-processor adds tokens (it counts such a prompt in one call)."""
        if self._plain_adds_tokens:
            return None
        return self.splitter.split(text), self._ref.force_bos

    def encode_plain(self, text: str, *, add_special_tokens: bool) -> list[int]:
        if add_special_tokens and self._plain_adds_tokens:
            return self._ref.encode_plain(text, add_special_tokens=True)
        ids = self.encode_rendered(text)
        bos = self._ref.force_bos
        if add_special_tokens and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def token_id(self, token: str) -> int | None:
        return self._ref.token_id(token)


_built: dict[tuple[str, int, int, bool], tuple[Any, FastPlan] | str] = {}
_built_lock = threading.Lock()


def _core_for(path: Path, tokenizer_json: Mapping[str, Any], reference: HFEncoder,
              added: Mapping[str, int] | None) -> tuple[Any, FastPlan] | str:
    """Build (once per file version) tiktoken's core, or say why not."""
    import tiktoken

    stat = path.stat()
    # the same file counted with and without its normalizer (llama.cpp skips NFC)
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size,
           tokenizer_json.get("normalizer") is None)
    with _built_lock:
        if key in _built:
            return _built[key]
        plan = plan_fast_bpe(tokenizer_json, added)
        result: tuple[Any, FastPlan] | str
        if isinstance(plan, str):
            result = plan
        elif not _vocab_merges_to_itself(reference, tokenizer_json):
            result = "a vocab entry does not merge to itself and ignore_merges is off"
        else:
            try:
                core = tiktoken.Encoding(f"kvgate:{path.parent.name}", pat_str=plan.pat_str,
                                         mergeable_ranks=plan.ranks, special_tokens={})
            except ValueError as exc:  # e.g. a regex the Rust engine refuses
                result = f"tiktoken refused the tokenizer: {exc}"
            else:
                result = (core, plan)
        _built[key] = result
        return result


def try_fast(path: Path, tokenizer_json: Mapping[str, Any],
             reference: HFEncoder) -> tuple[ByteLevelBPEEncoder | None, str]:
    """The fast encoder if structure and the probe self-check prove it exact, else why not."""
    if not fast_bpe_enabled():
        return None, f"{ENV_SWITCH}=0"
    if reference.splitter is None:
        return None, "it needs segment splitting"
    built = _core_for(path, tokenizer_json, reference, reference.added_tokens)
    if isinstance(built, str):
        return None, built
    core, plan = built
    try:
        fast = ByteLevelBPEEncoder(reference=reference, core=core, plan=plan,
                                   splitter=reference.splitter)
    except ImportError:
        return None, "the `regex` package is needed for chained Split pre-tokenizers"
    except Exception as exc:  # a pattern the `regex` package refuses
        return None, f"a Split pattern does not compile in Python: {exc}"
    for i, probe in enumerate(PROBES):
        for text in (probe, " " + probe, probe + "\n", probe.upper()):
            if fast.encode_rendered(text) != reference.encode_rendered(text):
                return None, f"self-check: probe {i} encodes differently"
            for bos in (False, True):
                if (fast.encode_plain(text, add_special_tokens=bos)
                        != reference.encode_plain(text, add_special_tokens=bos)):
                    return None, f"self-check: probe {i} (plain) encodes differently"
    return fast, "ok"
