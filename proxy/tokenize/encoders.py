"""Text -> token ids: `tokenizers` (the reference) and tiktoken encodings by name.

Every encoder also splits rendered text on its added/special tokens
(`split_rendered`) and encodes the plain text between them (`encode_segment`).
Where the engine's tokenizer encodes those segments independently of each other,
a count is the sum over segments plus one per special token; that is what lets the
count cache (`proxy.tokenize.cache`) reuse a segment it has seen before. Not every
`tokenizer.json` is additive: a `Metaspace` pre-tokenizer with `prepend_scheme:
"first"` (Mistral v0.3, non-legacy Llama 2 conversions) prepends "▁" only to the
text at offset 0 of the whole input, so a segment after an added token encodes
differently on its own. `HFEncoder` checks additivity when it loads (by structure
and on probe strings) and otherwise encodes the rendered text whole. The fast
exact byte-level BPE encoder is in `proxy.tokenize.bytelevel`.

A tokenizer library that panics (a Rust panic is a `BaseException`) raises
`CountFailed` here instead; tiktoken encodings cut long whitespace runs out before
their core sees them (`proxy.tokenize.guard`).
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from proxy.tokenize.base import TokenizerLoadError
from proxy.tokenize.chunked import Cuts, cuts_for, floor_tokens
from proxy.tokenize.guard import (
    LONG_RUN,
    PATTERNS,
    CountFailed,
    RunCutter,
    is_panic,
    whitespace_runs,
)

__all__ = ["TIKTOKEN_NAMES", "HFEncoder", "SpecialSplitter", "TiktokenEncoder", "rank_file_name"]


def _trie_pattern(tokens: list[str]) -> str:
    """A regex matching exactly `tokens`, built from their prefix trie.

    At each position the regex follows the one branch whose next character fits,
    preferring the longer continuation (greedy `(?:...)?`) and backing off to a
    token that ends earlier: the longest token that starts there, as a longest-first
    alternation matches, but without trying every token at every position (818
    alternatives for DeepSeek V3). Chains with one child and no token ending in
    them are written as one literal.
    """
    trie: dict[str, Any] = {}
    for token in tokens:
        node = trie
        for ch in token:
            node = node.setdefault(ch, {})
        node[""] = {}  # a token ends here

    def emit(node: dict[str, Any]) -> str:
        alts: list[str] = []
        for ch in sorted(k for k in node if k):
            literal, child = ch, node[ch]
            while "" not in child and len(child) == 1:
                ((nxt, child),) = child.items()
                literal += nxt
            alts.append(re.escape(literal) + emit(child))
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else f"(?:{'|'.join(alts)})"
        return f"(?:{body})?" if "" in node else body

    return emit(trie)


class SpecialSplitter:
    """Finds added tokens in text as `tokenizers` does: leftmost, then longest.

    `tokenizers` matches added tokens with Aho-Corasick, leftmost-longest: the
    regex scans for the leftmost position where a token starts and takes the
    longest token there ("<|im_start|>" before "<|im"), then goes on after it.
    """

    def __init__(self, tokens: Mapping[str, int]) -> None:
        self._ids = {t: i for t, i in tokens.items() if t}
        self._re = re.compile(_trie_pattern(list(self._ids))) if self._ids else None
        self.longest = max(map(len, self._ids), default=0)  # characters of one added token

    def split(self, text: str) -> list[str | int]:
        """Plain-text segments (non-empty `str`) and special token ids (`int`), in order."""
        if self._re is None:
            return [text] if text else []
        out: list[str | int] = []
        pos = 0
        ids = self._ids
        for m in self._re.finditer(text):
            start = m.start()
            if start > pos:
                out.append(text[pos:start])
            out.append(ids[m.group()])
            pos = m.end()
        if pos < len(text):
            out.append(text[pos:])
        return out


def hf_added_tokens(tokenizer_json: Mapping[str, Any]) -> dict[str, int] | None:
    """Added tokens if plain splitting on their text is exact, else None.

    Exact when no added token strips neighbouring whitespace or must be a whole
    word (`lstrip`, `rstrip`, `single_word`), and none is matched on normalized
    text while a normalizer changes text (then a match could depend on neighbours).
    """
    normalizer = tokenizer_json.get("normalizer")
    identity = normalizer is None or (
        normalizer.get("type") == "Sequence" and not normalizer.get("normalizers")
    )
    out: dict[str, int] = {}
    for tok in tokenizer_json.get("added_tokens") or []:
        if tok.get("lstrip") or tok.get("rstrip") or tok.get("single_word"):
            return None
        if tok.get("normalized") and not identity:
            return None
        out[str(tok["content"])] = int(tok["id"])
    return out


def _metaspace_first(pre: Any) -> bool:
    """A `Metaspace` pre-tokenizer (alone or in a `Sequence`) that prepends "▁" only
    at offset 0 of the whole text: segments between added tokens are not independent."""
    if not isinstance(pre, Mapping):
        return False
    if pre.get("type") == "Sequence":
        return any(_metaspace_first(p) for p in pre.get("pretokenizers") or [])
    return pre.get("type") == "Metaspace" and pre.get("prepend_scheme") == "first"


# Neighbours an added token is probed next to: words, spaces, newlines, the start
# and end of the text, and another added token.
_ADDITIVITY_CONTEXTS: tuple[str, ...] = (
    "{t}hello world{t}the quick brown fox{t}",
    "hello{t} world {t}  x\n{t}\ny\n\n{t}\n\nz",
    " {t} {t}{t}\t{t}end",
    "a{t}b 1{t}2 ▁{t}▁ 東京{t}é",
)
_ADDITIVITY_TOKENS = 8  # added tokens probed, spread over the table


def _added_token_probes(tokens: Mapping[str, int]) -> list[str]:
    by_id = sorted(tokens, key=lambda t: (tokens[t], t))
    step = max(1, len(by_id) // _ADDITIVITY_TOKENS)
    picked = by_id[::step][:_ADDITIVITY_TOKENS]
    return [ctx.format(t=tok) for tok in picked for ctx in _ADDITIVITY_CONTEXTS]


class HFEncoder:
    """A `tokenizers.Tokenizer` from `tokenizer.json`, with transformers' BOS rule."""

    def __init__(
        self,
        path: Path,
        *,
        add_bos_token: bool | None,
        bos_token: str | None,
        tokenizer_json: Mapping[str, Any] | None = None,
        from_json: bool = False,
    ) -> None:
        from tokenizers import Tokenizer

        # from_json: `tokenizer_json` as changed by the loader (its normalizer skipped)
        self._tok = (Tokenizer.from_str(json.dumps(tokenizer_json))
                     if from_json and tokenizer_json is not None
                     else Tokenizer.from_file(str(path)))
        self.description = "tokenizers"
        self.bound_description = "none (counted before admission)"
        self.fast = False
        # Normalizers and pre-tokenizers vary: no cut and no floor is claimed.
        self.cuts: Cuts | None = None
        added = hf_added_tokens(tokenizer_json) if tokenizer_json is not None else None
        # Without the token table (or with stripping added tokens, or a tokenizer
        # whose segments are not independent) the text is one segment: counts stay
        # exact, only the cache has nothing to reuse.
        self.added_tokens = added
        self.splitter: SpecialSplitter | None = None
        self.split_off: str | None = None  # why segment splitting is off, when it is
        if tokenizer_json is None:
            self.split_off = "no tokenizer.json table of added tokens"
        elif added is None:
            self.split_off = ("an added token strips whitespace, is single-word, "
                              "or is matched normalized")
        elif _metaspace_first(tokenizer_json.get("pre_tokenizer")):
            self.split_off = (
                "the Metaspace pre-tokenizer prepends '▁' only at the start of the whole "
                "text (prepend_scheme 'first')")
        else:
            splitter = SpecialSplitter(added)
            if added and not self._additive(splitter, _added_token_probes(added)):
                self.split_off = "text next to an added token encodes differently on its own"
            else:
                self.splitter = splitter
        # transformers' Llama-style fast tokenizers rebuild the post-processor from
        # `add_bos_token` (DeepSeek V3's tokenizer.json adds none, its config says True).
        self.force_bos: int | None = None
        if add_bos_token and bos_token is not None:
            self.force_bos = self._tok.token_to_id(bos_token)

    def encode_plain(self, text: str, *, add_special_tokens: bool) -> list[int]:
        try:
            ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except BaseException as exc:
            if is_panic(exc):
                raise CountFailed(f"tokenizers panicked on a prompt of {len(text)} "
                                  f"characters: {exc}") from exc
            raise
        bos = self.force_bos
        if add_special_tokens and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def _additive(self, splitter: SpecialSplitter, probes: list[str]) -> bool:
        """Whether encoding each probe whole gives the ids of its segments in turn."""
        for text in probes:
            ids: list[int] = []
            for part in splitter.split(text):
                if isinstance(part, int):
                    ids.append(part)
                else:
                    ids += self.encode_segment(part)
            if ids != self.encode_rendered(text):
                return False
        return True

    def encode_rendered(self, text: str) -> list[int]:
        # `tokenizers` splits added tokens out itself: the same call as a segment's.
        return self.encode_segment(text)

    def encode_segment(self, text: str) -> list[int]:
        """Text with no added token in it: one segment of `split_rendered`."""
        try:
            ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        except BaseException as exc:  # its own errors pass as they are; a panic cannot
            if is_panic(exc):
                raise CountFailed(f"tokenizers panicked on a segment of {len(text)} "
                                  f"characters: {exc}") from exc
            raise
        return ids

    def split_rendered(self, text: str) -> list[str | int]:
        if self.splitter is None:
            return [text] if text else []
        return self.splitter.split(text)

    def max_rendered_tokens(self, text: str) -> int | None:
        # Normalizers and pre-tokenizers vary (SentencePiece prepends a space, NFKC
        # may grow text): no bound is claimed, the exact count decides.
        return None

    def min_rendered_tokens(self, text: str) -> int:
        return 0

    def plain_parts(self, text: str) -> tuple[list[str | int], int | None] | None:
        return None  # no cuts: a plain prompt is counted in one call

    def token_id(self, token: str) -> int | None:
        tid: int | None = self._tok.token_to_id(token)
        return tid

    @property
    def tokenizer(self) -> Any:
        """The `tokenizers.Tokenizer` itself: the reference the fast path is checked on."""
        return self._tok


_tiktoken_lock = threading.Lock()

# The tiktoken encodings a model directory is searched for, in this order.
TIKTOKEN_NAMES = ("cl100k_base", "o200k_base", "o200k_harmony", "r50k_base", "p50k_base")
# Encodings whose ranks are another's file (they add only special tokens).
_RANK_FILES = {"o200k_harmony": "o200k_base", "p50k_edit": "p50k_base"}


def rank_file_name(encoding: str) -> str:
    """The `<name>.tiktoken` rank file an encoding reads."""
    return _RANK_FILES.get(encoding, encoding)


def _special_ids(enc: Any) -> dict[str, int]:
    """Special token -> id through tiktoken's public API."""
    return {token: int(enc.encode_single_token(token)) for token in enc.special_tokens_set}


def tiktoken_failure(exc: BaseException) -> bool:
    """What tiktoken's core raises where its regex gives up: a panic from
    `encode_ordinary`, a `ValueError("Regex error while tokenizing: ...")` from `encode`."""
    return is_panic(exc) or (isinstance(exc, ValueError) and str(exc).startswith("Regex error"))


def run_cutter(enc: Any) -> RunCutter | None:
    """The cutter for a `tiktoken.Encoding` whose pattern is proven to allow it."""
    pattern = getattr(enc, "_pat_str", None)
    if pattern not in PATTERNS:
        return None
    core = enc._core_bpe
    return RunCutter(pattern, encode_ordinary=enc.encode_ordinary,
                     encode_piece=core.encode_single_piece,
                     encode_long_run=gil_free_piece(enc))


_NO_TEXT = b"\xff"  # a byte no UTF-8 text holds


def gil_free_piece(enc: Any) -> Callable[[str], list[int]] | None:
    """BPE of one piece in a call that releases the GIL, for a `tiktoken.Encoding`
    where it is exact; None elsewhere.

    The core's `encode_single_piece` holds the GIL: 3.4 s for a 4 MB whitespace run
    (o200k), the event loop frozen all that time. Its `_encode_bytes` releases it and,
    given bytes that are not UTF-8 from their first byte on, is BPE of them all
    (`byte_pair_encode`, what `encode_single_piece` runs). So the piece goes in behind
    0xFF, where 0xFF is a token and no other token holds that byte: no merge can join
    it to the piece, so BPE of the two is [0xFF] + BPE of the piece (BPE's merges never
    cross a boundary no merge rule spans). tests/test_hostile_counting.py checks it
    against `encode_single_piece`, per encoding.
    """
    ranks: dict[bytes, int] | None = getattr(enc, "_mergeable_ranks", None)
    core = getattr(enc, "_core_bpe", None)
    if (not ranks or core is None or not hasattr(core, "_encode_bytes")
            or _NO_TEXT not in ranks
            or any(0xFF in token for token in ranks if token != _NO_TEXT)):
        return None
    encode_bytes = core._encode_bytes

    def bpe(piece: str) -> list[int]:
        ids: list[int] = encode_bytes(_NO_TEXT + piece.encode("utf-8"))
        return ids[1:]

    return bpe


class TiktokenEncoder:
    """A tiktoken encoding loaded from a local rank file, never from the network.

    Text with a whitespace run of `LONG_RUN` characters or more is encoded with the run
    cut out (`RunCutter`; every OpenAI pattern is proven to allow it): tiktoken itself
    would stop there (a panic, or a ValueError). What still fails is `CountFailed`.
    """

    def __init__(self, name: str, rank_file: Path | None) -> None:
        import tiktoken
        import tiktoken.load
        from tiktoken_ext import openai_public

        constructors: Mapping[str, Any] = openai_public.ENCODING_CONSTRUCTORS
        if name not in constructors:
            raise TokenizerLoadError(
                f"unknown tiktoken encoding {name!r}; expected one of {sorted(constructors)}"
            )
        self.description = f"tiktoken {name}"
        self.bound_description = "UTF-8 bytes of the rendered chat"
        self.fast = True
        if rank_file is None:
            self._enc = self._from_cache(name)
            self._special = _special_ids(self._enc)
            self.splitter = SpecialSplitter(self._special)
            self._cutter = run_cutter(self._enc)
            self._chunking()
            return
        real_loader = openai_public.load_tiktoken_bpe

        def local_loader(_url: str, expected_hash: str | None = None) -> dict[bytes, int]:
            ranks: dict[bytes, int] = tiktoken.load.load_tiktoken_bpe(
                str(rank_file), expected_hash=expected_hash
            )
            return ranks

        # tiktoken's constructors hold the pattern and special tokens (one source of
        # truth); only the rank loader is pointed at the local file, and the hash is
        # still checked.
        with _tiktoken_lock:
            openai_public.load_tiktoken_bpe = local_loader
            try:
                spec = constructors[name]()
            except ValueError as exc:
                raise TokenizerLoadError(f"{rank_file}: {exc}") from exc
            finally:
                openai_public.load_tiktoken_bpe = real_loader
        self._enc = tiktoken.Encoding(
            spec["name"],
            pat_str=spec["pat_str"],
            mergeable_ranks=spec["mergeable_ranks"],
            special_tokens=spec["special_tokens"],
            explicit_n_vocab=spec.get("explicit_n_vocab"),
        )
        self._special = _special_ids(self._enc)
        # tiktoken itself finds specials with a regex and encodes the text between
        # them separately: splitting first gives the same ids.
        self.splitter = SpecialSplitter(self._special)
        self._cutter = run_cutter(self._enc)
        self._chunking()

    def _chunking(self) -> None:
        """Where long segments may be cut (`Cuts`), and the longest text one id covers."""
        self.cuts = cuts_for(getattr(self._enc, "_pat_str", ""))
        ranks: Mapping[bytes, int] = getattr(self._enc, "_mergeable_ranks", {})
        self._longest = max(max(map(len, ranks), default=0), self.splitter.longest)

    @staticmethod
    def _from_cache(name: str) -> Any:
        """tiktoken's own cache directory, refusing anything that would download."""
        import hashlib
        import tempfile

        import tiktoken

        rank_name = rank_file_name(name)
        if rank_name not in TIKTOKEN_NAMES:  # gpt2 reads other files
            raise TokenizerLoadError(f"tiktoken encoding {name!r} needs a local rank file")
        url = f"https://openaipublic.blob.core.windows.net/encodings/{rank_name}.tiktoken"
        cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
        cache = Path(cache_dir or Path(tempfile.gettempdir()) / "data-gym-cache")
        cached = cache / hashlib.sha1(url.encode()).hexdigest()
        if not cached.is_file():
            raise TokenizerLoadError(
                f"tiktoken encoding {name!r} is not in tiktoken's cache ({cached}); "
                "kvgate never downloads at run time: give the .tiktoken file"
            )
        return tiktoken.get_encoding(name)

    def _failed(self, exc: BaseException, text: str) -> CountFailed:
        return CountFailed(f"{self.description} failed on a text of {len(text)} "
                           f"characters: {exc}")

    def _cut(self, text: str) -> list[int]:
        """Text with a long whitespace run, no special tokens: cut, or `CountFailed`."""
        if self._cutter is None:
            raise CountFailed(f"{self.description} cannot count a run of "
                              f"{LONG_RUN:,}+ whitespace characters exactly")
        return self._cutter.encode(text)

    def encode_plain(self, text: str, *, add_special_tokens: bool) -> list[int]:
        # OpenAI's encodings add no BOS; special-token text in a prompt is plain text.
        if len(text) >= LONG_RUN and whitespace_runs(text):
            return self._cut(text)
        try:
            ids: list[int] = self._enc.encode(text, disallowed_special=())
        except BaseException as exc:
            if tiktoken_failure(exc):
                raise self._failed(exc, text) from exc
            raise
        return ids

    def encode_rendered(self, text: str) -> list[int]:
        if len(text) >= LONG_RUN and whitespace_runs(text):
            ids: list[int] = []
            for part in self.splitter.split(text):
                if isinstance(part, int):
                    ids.append(part)
                else:
                    ids += self.encode_segment(part)
            return ids
        try:
            ids = self._enc.encode(text, allowed_special="all")
        except BaseException as exc:
            if tiktoken_failure(exc):
                raise self._failed(exc, text) from exc
            raise
        return ids

    def encode_segment(self, text: str) -> list[int]:
        if len(text) >= LONG_RUN and whitespace_runs(text):
            return self._cut(text)
        try:
            ids: list[int] = self._enc.encode_ordinary(text)
        except BaseException as exc:
            if tiktoken_failure(exc):
                raise self._failed(exc, text) from exc
            raise
        return ids

    def max_rendered_tokens(self, text: str) -> int | None:
        # Byte-level BPE without a normalizer: each token is at least one byte of the
        # text, and a special token's text is longer than its one id.
        return len(text.encode("utf-8", "surrogatepass"))

    def plain_parts(self, text: str) -> tuple[list[str | int], int | None] | None:
        # `encode_plain` takes special-token text as plain text, and adds no BOS.
        return ([text] if text else []), None

    def min_rendered_tokens(self, text: str) -> int:
        if not self._longest:
            return 0
        return floor_tokens(text, longest_token_chars=self._longest, nfc=False)

    def split_rendered(self, text: str) -> list[str | int]:
        return self.splitter.split(text)

    def token_id(self, token: str) -> int | None:
        return self._special.get(token)

