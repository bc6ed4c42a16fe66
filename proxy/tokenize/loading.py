"""A model directory (as vLLM is given one) or `tiktoken:<name>` -> a counter."""

from __future__ import annotations

from pathlib import Path

from proxy.tokenize.base import Encoder, PromptCounter, TokenizerLoadError
from proxy.tokenize.bytelevel import try_fast
from proxy.tokenize.cache import DEFAULT_CACHE_BYTES
from proxy.tokenize.counting import TokenCounter
from proxy.tokenize.encoders import TIKTOKEN_NAMES, HFEncoder, TiktokenEncoder, rank_file_name
from proxy.tokenize.mistral import MistralTokenCounter
from proxy.tokenize.templates import read_chat_template, read_json, special_token_text

__all__ = ["load_counter"]


def load_counter(
    model_dir: str | Path,
    *,
    name: str | None = None,
    encoding: str | None = None,
    cache_bytes: int = DEFAULT_CACHE_BYTES,
    unicode_normalizer: bool = True,
) -> PromptCounter:
    """Load a model directory as vLLM is given one, or `tiktoken:<encoding>`.

    Recognised: `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja`
    or `chat_template.json`), or a `<encoding>.tiktoken` rank file (`encoding`
    picks one; `o200k_harmony` reads `o200k_base.tiktoken` and adds its specials), or
    Mistral's `tekken.json` (through mistral-common, when installed).

    `unicode_normalizer=False` counts as llama.cpp does: it skips a tokenizer's NFC
    normalizer (and nothing else), so text with decomposed accents holds more tokens
    there (measured: up to +3.4% on the Qwen3 corpus) than vLLM, which applies it.

    A byte-level BPE `tokenizer.json` counts on tiktoken's core where that is proven
    exact (`proxy.tokenize.bytelevel`); `cache_bytes` bounds the count cache of
    repeated prompt segments (0 turns it off).
    """
    spec = str(model_dir)
    if spec.startswith("tiktoken:"):
        encoding = spec.removeprefix("tiktoken:")
        return TokenCounter(
            name=name or encoding,
            encoder=TiktokenEncoder(encoding, None),
            chat_template=None,
            special_tokens={},
            cache_bytes=cache_bytes,
        )
    path = Path(model_dir)
    if not path.is_dir():
        raise TokenizerLoadError(f"model directory {str(path)!r} does not exist")
    config_file = path / "tokenizer_config.json"
    config = read_json(config_file) if config_file.is_file() else {}
    template = read_chat_template(path, config)
    special = {
        key: text
        for key in ("bos_token", "eos_token", "unk_token", "pad_token")
        if (text := special_token_text(config.get(key))) is not None
    }
    label = name or path.name
    if (path / "tokenizer.json").is_file():
        add_bos = config.get("add_bos_token")
        if config.get("tokenizer_class") not in ("LlamaTokenizerFast", "LlamaTokenizer"):
            add_bos = None  # only Llama-style tokenizers rebuild BOS from the config
        tokenizer_json = read_json(path / "tokenizer.json")
        skipped = None
        if not unicode_normalizer and _is_nfc(tokenizer_json.get("normalizer")):
            skipped, tokenizer_json = "NFC", {**tokenizer_json, "normalizer": None}
        reference = HFEncoder(
            path / "tokenizer.json",
            add_bos_token=bool(add_bos) if add_bos is not None else None,
            bos_token=special.get("bos_token"),
            tokenizer_json=tokenizer_json,
            from_json=skipped is not None,
        )
        fast, why = try_fast(path / "tokenizer.json", tokenizer_json, reference)
        encoder: Encoder = fast if fast is not None else reference
        if fast is None:
            reference.description = f"tokenizers (fast path off: {why})"
        if skipped is not None:
            encoder.description += f"; {skipped} normalizer skipped, as the engine does"
        if reference.split_off is not None:
            reference.description += (
                f"; segment splitting off (prompts encoded whole): {reference.split_off}")
        return TokenCounter(
            name=label, encoder=encoder, chat_template=template, special_tokens=special,
            cache_bytes=cache_bytes,
        )
    for candidate in (encoding,) if encoding else TIKTOKEN_NAMES:
        rank_file = path / f"{rank_file_name(candidate)}.tiktoken"
        if rank_file.is_file():
            return TokenCounter(
                name=label,
                encoder=TiktokenEncoder(candidate, rank_file),
                chat_template=template,
                special_tokens=special,
                cache_bytes=cache_bytes,
            )
    if (path / "tekken.json").is_file():
        return MistralTokenCounter(path / "tekken.json", name=label)
    raise TokenizerLoadError(
        f"{path} has no tokenizer: expected tokenizer.json or a <encoding>.tiktoken file"
    )


def _is_nfc(normalizer: object) -> bool:
    """An NFC normalizer, alone or as the only step of a Sequence."""
    if not isinstance(normalizer, dict):
        return False
    if normalizer.get("type") == "Sequence":
        steps = normalizer.get("normalizers") or []
        return len(steps) == 1 and _is_nfc(steps[0])
    return normalizer.get("type") == "NFC"
