"""The types every part of counting shares: the request, the protocols, the errors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from proxy.tokenize.cache import CacheStats
    from proxy.tokenize.chunked import Cuts

__all__ = ["ChatRequest", "Encoder", "PromptCounter", "RenderedChat", "TemplateError",
           "TokenizerLoadError"]


class TokenizerLoadError(ValueError):
    """A model directory cannot give an exact count (no tokenizer, unsupported format)."""


class TemplateError(ValueError):
    """The chat template refused the messages; its own message is passed through."""


class Encoder(Protocol):
    """Text -> ids for one model; `split_rendered` + `encode_segment` give the same ids
    as `encode_rendered`, segment by segment (what the count cache relies on)."""

    description: str
    fast: bool
    bound_description: str  # what `max_rendered_tokens` bounds, for `kvgate check-config`
    cuts: Cuts | None  # where a long segment may be cut with its ids unchanged

    def encode_plain(self, text: str, *, add_special_tokens: bool) -> list[int]: ...
    def encode_rendered(self, text: str) -> list[int]: ...
    def split_rendered(self, text: str) -> list[str | int]: ...
    def encode_segment(self, text: str) -> list[int]: ...
    def token_id(self, token: str) -> int | None: ...

    def max_rendered_tokens(self, text: str) -> int | None:
        """A true upper bound on `len(encode_rendered(text))`, found without encoding
        (UTF-8 bytes, where every token covers at least one byte of the text); None
        where no such bound is proven for this tokenizer or this text."""
        ...

    def plain_parts(self, text: str) -> tuple[list[str | int], int | None] | None:
        """`encode_plain(text, add_special_tokens=True)` as parts for `encode_segment`
        (ids as int) and the BOS id put first where the first id is not it; None where
        a plain prompt is counted in one call."""
        ...

    def min_rendered_tokens(self, text: str) -> int:
        """A true lower bound on `len(encode_rendered(text))` from its length alone
        (`proxy.tokenize.chunked.floor_tokens`); 0 where none is proven."""
        ...


@dataclass(frozen=True, slots=True)
class RenderedChat:
    """A chat after its template, before encoding; `max_tokens` as the encoder bounds it."""

    text: str
    max_tokens: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatRequest:
    """What a chat template sees: the request's messages and options, validated."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    template_kwargs: Mapping[str, Any] | None = None
    # The final (assistant) message is continued, not closed: rendered without the end
    # of its turn and without a generation prompt (transformers' and vLLM's option).
    continue_final_message: bool = False
    # The size of the body it came from: a large one is rendered in the thread pool.
    source_bytes: int = field(default=0, compare=False)

    def as_llama_cpp_reads(self) -> ChatRequest:
        """llama.cpp continues a final assistant message (its `prefill_assistant`, on by
        default), whatever the request's own options say."""
        if self.messages and self.messages[-1].get("role") == "assistant" \
                and not self.continue_final_message:
            return replace(self, continue_final_message=True, add_generation_prompt=False)
        return self


class PromptCounter(Protocol):
    """What the request path needs from a model's tokenizer."""

    name: str

    @property
    def has_chat_template(self) -> bool: ...

    @property
    def encoder_description(self) -> str: ...

    @property
    def bound_description(self) -> str: ...

    def cache_stats(self) -> CacheStats | None: ...

    def count_chat(self, chat: ChatRequest, limit: int | None = None) -> int:
        """`limit` as for `count_chat_async`."""
        ...

    def count_prompt(self, prompt: str | Sequence[int], limit: int | None = None) -> int: ...

    async def count_chat_async(self, chat: ChatRequest, limit: int | None = None) -> int:
        """`limit`: the most prompt tokens that could ever be admitted; a counter may
        stop once the count passes it (`CountExceeded`), or count on."""
        ...

    def render_for_count(self, chat: ChatRequest) -> RenderedChat | None:
        """The rendered chat and its token bound, cheaply on the event loop; None where
        this counter renders and counts in one step or the chat is too long to render
        inline. Raises `TemplateError` as `count_chat` would."""
        ...

    async def count_rendered_async(self, rendered: RenderedChat,
                                   limit: int | None = None) -> int:
        """Exactly `count_chat_async` of the chat `rendered` came from."""
        ...

    async def count_prompt_async(self, prompt: str | Sequence[int],
                                 limit: int | None = None) -> int: ...

