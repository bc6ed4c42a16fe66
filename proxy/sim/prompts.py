"""A request's prompts as the simulated engine takes them: a count, and token ids.

The ids are what prefix caching keys on, so they come from the same place as the count:

* with a model's tokenizer (`--model-dir`), the ids it encodes: a chat's rendered
  template, a completion's text with the tokenizer's BOS rule;
* without one, synthetic ids that follow the estimate the count comes from (two per
  request, four per message from its role, then one per four characters of content, each
  the CRC-32 of those characters): equal leading text gives equal leading ids, as a real
  tokenizer would, and the count is unchanged;
* token-id prompts (`/v1/completions`), the ids given.

A counter that renders and encodes in one step with no ids to hand (Mistral's) gives the
count only: its prompts share no blocks.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.tokenize import PromptCounter
from proxy.validation import ValidRequest

__all__ = ["Prompt", "estimate_chat", "prompts_of"]

_START = (0x6B76, 0x6761)  # the two tokens every estimated chat starts with


@dataclass(frozen=True, slots=True)
class Prompt:
    tokens: int
    token_ids: list[int] | None = None  # None: counted only, so nothing to share


def _content(message: Mapping[str, Any]) -> str:
    content = message.get("content") or ""
    if isinstance(content, list):
        content = "\n".join(str(p.get("text", "")) for p in content)
    return str(content)


def estimate_chat(messages: list[dict[str, Any]]) -> int:
    """One token per 4 characters of content, 4 per message, 2 per request."""
    return 2 + sum(4 + math.ceil(len(_content(m)) / 4) for m in messages)


def _text_ids(text: str) -> list[int]:
    return [zlib.crc32(text[i:i + 4].encode()) for i in range(0, len(text), 4)]


def _estimated_chat_ids(messages: list[dict[str, Any]]) -> list[int]:
    ids = list(_START)
    for message in messages:
        role = str(message.get("role", ""))
        ids += (zlib.crc32(f"<{role}:{k}>".encode()) for k in range(4))
        ids += _text_ids(_content(message))
    return ids


def _estimated_text_ids(text: str) -> list[int]:
    return _text_ids(text) or [zlib.crc32(b"")]  # an empty prompt is one token


def _encoder_ids(counter: PromptCounter, text: str) -> list[int] | None:
    """The counter's ids for a completion prompt, where it gives ids (Mistral's: none)."""
    encode = getattr(counter, "prompt_token_ids", None)
    if encode is None:
        return None
    ids: list[int] = encode(text)
    return ids


def prompts_of(counter: PromptCounter | None, req: ValidRequest, *,
               token_ids: bool) -> list[Prompt]:
    """One `Prompt` per prompt of the request (a chat has one); ids only if asked."""
    if req.chat is not None:
        if counter is None:
            if token_ids:
                ids = _estimated_chat_ids(req.chat.messages)
                return [Prompt(len(ids), ids)]
            return [Prompt(estimate_chat(req.chat.messages))]
        chat_ids = getattr(counter, "chat_token_ids", None)
        if token_ids and chat_ids is not None:
            ids = list(chat_ids(req.chat))
            return [Prompt(len(ids), ids)]
        return [Prompt(counter.count_chat(req.chat))]
    out: list[Prompt] = []
    for prompt in req.prompts:
        if not isinstance(prompt, str):
            out.append(Prompt(len(prompt), list(prompt) if token_ids else None))
        elif counter is None:
            if token_ids:
                ids = _estimated_text_ids(prompt)
                out.append(Prompt(len(ids), ids))
            else:
                out.append(Prompt(max(1, math.ceil(len(prompt) / 4))))
        else:
            text_ids = _encoder_ids(counter, prompt) if token_ids else None
            out.append(Prompt(len(text_ids), text_ids) if text_ids is not None
                       else Prompt(counter.count_prompt(prompt)))
    return out
