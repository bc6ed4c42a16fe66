"""The types every part of counting shares: the request, the protocols, the errors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from proxy.tokenize.cache import CacheStats

__all__ = ["ChatRequest", "Encoder", "PromptCounter", "TemplateError", "TokenizerLoadError"]


class TokenizerLoadError(ValueError):
    """A model directory cannot give an exact count (no tokenizer, unsupported format)."""


class TemplateError(ValueError):
    """The chat template refused the messages; its own message is passed through."""


class Encoder(Protocol):
    """Text -> ids for one model; `split_rendered` + `encode_segment` give the same ids
    as `encode_rendered`, segment by segment (what the count cache relies on)."""

    description: str
    fast: bool

    def encode_plain(self, text: str, *, add_special_tokens: bool) -> list[int]: ...
    def encode_rendered(self, text: str) -> list[int]: ...
    def split_rendered(self, text: str) -> list[str | int]: ...
    def encode_segment(self, text: str) -> list[int]: ...
    def token_id(self, token: str) -> int | None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatRequest:
    """What a chat template sees: the request's messages and options, validated."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    template_kwargs: Mapping[str, Any] | None = None


class PromptCounter(Protocol):
    """What the request path needs from a model's tokenizer."""

    name: str

    @property
    def has_chat_template(self) -> bool: ...

    @property
    def encoder_description(self) -> str: ...

    def cache_stats(self) -> CacheStats | None: ...

    def count_chat(self, chat: ChatRequest) -> int: ...

    def count_prompt(self, prompt: str | Sequence[int]) -> int: ...

    async def count_chat_async(self, chat: ChatRequest) -> int: ...

    async def count_prompt_async(self, prompt: str | Sequence[int]) -> int: ...

