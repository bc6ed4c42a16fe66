"""Text -> token ids: `tokenizers` (the reference), tiktoken encodings by name."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from proxy.tokenize.base import TokenizerLoadError

__all__ = ["HFEncoder", "TiktokenEncoder"]


class HFEncoder:
    """A `tokenizers.Tokenizer` from `tokenizer.json`, with transformers' BOS rule."""

    def __init__(self, path: Path, *, add_bos_token: bool | None, bos_token: str | None) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        # transformers' Llama-style fast tokenizers rebuild the post-processor from
        # `add_bos_token` (DeepSeek V3's tokenizer.json adds none, its config says True).
        self._force_bos: int | None = None
        if add_bos_token and bos_token is not None:
            self._force_bos = self._tok.token_to_id(bos_token)

    def encode_plain(self, text: str, *, add_special_tokens: bool) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self._force_bos
        if add_special_tokens and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def encode_rendered(self, text: str) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        return ids

    def token_id(self, token: str) -> int | None:
        tid: int | None = self._tok.token_to_id(token)
        return tid


_tiktoken_lock = threading.Lock()


class TiktokenEncoder:
    """A tiktoken encoding loaded from a local rank file, never from the network."""

    def __init__(self, name: str, rank_file: Path | None) -> None:
        import tiktoken
        import tiktoken.load
        from tiktoken_ext import openai_public

        constructors: Mapping[str, Any] = openai_public.ENCODING_CONSTRUCTORS
        if name not in constructors:
            raise TokenizerLoadError(
                f"unknown tiktoken encoding {name!r}; expected one of {sorted(constructors)}"
            )
        if rank_file is None:
            self._enc = self._from_cache(name)
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

    @staticmethod
    def _from_cache(name: str) -> Any:
        """tiktoken's own cache directory, refusing anything that would download."""
        import hashlib
        import tempfile

        import tiktoken

        urls = {
            "cl100k_base": "cl100k_base",
            "o200k_base": "o200k_base",
            "o200k_harmony": "o200k_base",
            "r50k_base": "r50k_base",
            "p50k_base": "p50k_base",
            "p50k_edit": "p50k_base",
        }
        if name not in urls:
            raise TokenizerLoadError(f"tiktoken encoding {name!r} needs a local rank file")
        url = f"https://openaipublic.blob.core.windows.net/encodings/{urls[name]}.tiktoken"
        cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
        cache = Path(cache_dir or Path(tempfile.gettempdir()) / "data-gym-cache")
        cached = cache / hashlib.sha1(url.encode()).hexdigest()
        if not cached.is_file():
            raise TokenizerLoadError(
                f"tiktoken encoding {name!r} is not in tiktoken's cache ({cached}); "
                "kvgate never downloads at run time: give the .tiktoken file"
            )
        return tiktoken.get_encoding(name)

    def encode_plain(self, text: str, *, add_special_tokens: bool) -> list[int]:
        # OpenAI's encodings add no BOS; special-token text in a prompt is plain text.
        ids: list[int] = self._enc.encode(text, disallowed_special=())
        return ids

    def encode_rendered(self, text: str) -> list[int]:
        ids: list[int] = self._enc.encode(text, allowed_special="all")
        return ids

    def token_id(self, token: str) -> int | None:
        special: dict[str, int] = self._enc._special_tokens
        return special.get(token)

