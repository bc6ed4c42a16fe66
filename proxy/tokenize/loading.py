"""A model directory (as vLLM is given one) or `tiktoken:<name>` -> a counter."""

from __future__ import annotations

from pathlib import Path

from proxy.tokenize.base import Encoder, PromptCounter, TokenizerLoadError
from proxy.tokenize.counting import MistralTokenCounter, TokenCounter
from proxy.tokenize.encoders import HFEncoder, TiktokenEncoder
from proxy.tokenize.templates import read_chat_template, read_json, special_token_text

__all__ = ["load_counter"]


_TIKTOKEN_NAMES = ("cl100k_base", "o200k_base", "o200k_harmony", "r50k_base", "p50k_base")


_RANK_FILES = {"o200k_harmony": "o200k_base", "p50k_edit": "p50k_base"}


def load_counter(
    model_dir: str | Path, *, name: str | None = None, encoding: str | None = None
) -> PromptCounter:
    """Load a model directory as vLLM is given one, or `tiktoken:<encoding>`.

    Recognised: `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja`
    or `chat_template.json`), or a `<encoding>.tiktoken` rank file (`encoding`
    picks one; `o200k_harmony` reads `o200k_base.tiktoken` and adds its specials), or
    Mistral's `tekken.json` (through mistral-common, when installed).
    """
    spec = str(model_dir)
    if spec.startswith("tiktoken:"):
        encoding = spec.removeprefix("tiktoken:")
        return TokenCounter(
            name=name or encoding,
            encoder=TiktokenEncoder(encoding, None),
            chat_template=None,
            special_tokens={},
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
        encoder: Encoder = HFEncoder(
            path / "tokenizer.json",
            add_bos_token=bool(add_bos) if add_bos is not None else None,
            bos_token=special.get("bos_token"),
        )
        return TokenCounter(
            name=label, encoder=encoder, chat_template=template, special_tokens=special
        )
    for candidate in (encoding,) if encoding else _TIKTOKEN_NAMES:
        rank_file = path / f"{_RANK_FILES.get(candidate, candidate)}.tiktoken"
        if rank_file.is_file():
            return TokenCounter(
                name=label,
                encoder=TiktokenEncoder(candidate, rank_file),
                chat_template=template,
                special_tokens=special,
            )
    if (path / "tekken.json").is_file():
        return MistralTokenCounter(path / "tekken.json", name=label)
    raise TokenizerLoadError(
        f"{path} has no tokenizer: expected tokenizer.json or a <encoding>.tiktoken file"
    )
