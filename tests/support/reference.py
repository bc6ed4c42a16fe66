"""transformers as the reference counter (test-only; no torch needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def hf_tokenizer(model_dir: Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    for key in ("added_tokens_decoder", "tokenizer_class", "auto_map", "processor_class"):
        cfg.pop(key, None)
    for key, value in list(cfg.items()):
        if isinstance(value, dict) and value.get("__type") == "AddedToken":
            cfg[key] = value["content"]
    tok = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"), **cfg)
    template = model_dir / "chat_template.jinja"
    if template.is_file():
        tok.chat_template = template.read_text()
    return tok


def hf_count(tok: Any, request: dict[str, Any]) -> int:
    ids = tok.apply_chat_template(
        request["messages"],
        tools=request.get("tools"),
        add_generation_prompt=request.get("add_generation_prompt", True),
        tokenize=True,
    )
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return len(ids)
