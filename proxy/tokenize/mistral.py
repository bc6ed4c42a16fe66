"""Mistral's tekken tokenizer through mistral-common: the counter vLLM's
`--tokenizer-mode mistral` counts with, guarded against the runs that break tiktoken.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from proxy.tokenize.base import ChatRequest, RenderedChat, TemplateError, TokenizerLoadError
from proxy.tokenize.cache import CacheStats
from proxy.tokenize.counting import OffLoopCounter
from proxy.tokenize.encoders import run_cutter, tiktoken_failure
from proxy.tokenize.guard import LONG_RUN, CountFailed, RunCutter, is_panic, whitespace_runs

__all__ = ["MistralTokenCounter"]


class MistralTokenCounter(OffLoopCounter):
    """Mistral's `tekken.json` through mistral-common, as vLLM's `--tokenizer-mode mistral`.

    vLLM renders Mistral chats with mistral-common's own request encoder, not a jinja
    template, so the count comes from the same library. Optional: `pip install
    kvgate[mistral]`.
    """

    def __init__(self, path: Path, *, name: str) -> None:
        try:
            from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
        except ImportError as exc:
            raise TokenizerLoadError(
                f"{path.parent} has Mistral's tekken.json; counting it needs mistral-common "
                "(pip install 'kvgate[mistral]')"
            ) from exc
        self.name = name
        try:
            self._tok = MistralTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises many kinds on a bad file
            raise TokenizerLoadError(f"{path} is not a usable tekken tokenizer: {exc}") from exc
        self.guarded = _guard_tekken(self._tok)

    encoder_description = "mistral-common (tekken)"
    bound_description = "none (counted before admission)"

    def cache_stats(self) -> CacheStats | None:
        return None

    @property
    def has_chat_template(self) -> bool:
        return True

    def _failed(self, exc: BaseException) -> CountFailed:
        return CountFailed(f"model {self.name!r}: mistral-common's tokenizer failed: {exc}")

    def count_chat(self, chat: ChatRequest, limit: int | None = None) -> int:
        from mistral_common.exceptions import MistralCommonException
        from mistral_common.protocol.instruct.messages import AssistantMessage
        from mistral_common.protocol.instruct.request import ChatCompletionRequest
        from pydantic import ValidationError

        if not chat.messages:
            raise TemplateError("`messages` must not be empty")
        messages = [{k: v for k, v in m.items() if v is not None} for m in chat.messages]
        for message in messages:
            # mistral-common takes an assistant's content only as a string (vLLM joins it)
            content = message.get("content")
            if message.get("role") == "assistant" and isinstance(content, list):
                message["content"] = "\n".join(
                    str(part.get("text", "")) for part in content if isinstance(part, Mapping))
        try:
            request = ChatCompletionRequest.from_openai(messages=messages, tools=chat.tools)
            last = request.messages[-1]
            if isinstance(last, AssistantMessage):
                # vLLM's Mistral mode continues a final assistant message as a prefix
                # (`prefix=True`: no end-of-turn), where mistral-common alone refuses it.
                request.messages[-1] = last.model_copy(update={"prefix": True})
            tokens: list[int] = self._tok.encode_chat_completion(request).tokens
        except (MistralCommonException, ValidationError, ValueError, TypeError) as exc:
            if tiktoken_failure(exc):  # the text broke tiktoken's regex: not the client's fault
                raise self._failed(exc) from exc
            raise TemplateError(f"Mistral request encoder rejected the request: {exc}") from exc
        except BaseException as exc:
            if is_panic(exc):
                raise self._failed(exc) from exc
            raise
        return len(tokens)

    def render_for_count(self, chat: ChatRequest) -> RenderedChat | None:
        return None  # mistral-common renders and encodes in one step

    async def count_rendered_async(self, rendered: RenderedChat,
                                   limit: int | None = None) -> int:
        raise TypeError("MistralTokenCounter renders nothing apart: use count_chat_async")

    def count_prompt(self, prompt: str | Sequence[int], limit: int | None = None) -> int:
        if isinstance(prompt, str):
            try:
                ids: list[int] = self._tok.instruct_tokenizer.tokenizer.encode(
                    prompt, bos=True, eos=False
                )
            except BaseException as exc:
                if tiktoken_failure(exc):
                    raise self._failed(exc) from exc
                raise
            return len(ids)
        return len(prompt)


class _GuardedEncoding:
    """A tekken tokenizer's `tiktoken.Encoding` whose `encode(text)` cuts long
    whitespace runs out (`RunCutter`) before tiktoken's core would fail on them.

    mistral-common's `Tekkenizer.encode` calls `self._model.encode(s)` for prompts and
    for every message of a chat; the encoding has no special tokens, so that is
    `encode_ordinary`. Everything else passes through to the encoding itself.
    """

    def __init__(self, enc: Any, cutter: RunCutter) -> None:
        self._enc = enc
        self._cutter = cutter

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        if not kwargs and len(text) >= LONG_RUN and whitespace_runs(text):
            return self._cutter.encode(text)
        ids: list[int] = self._enc.encode(text, **kwargs)
        return ids

    def __getattr__(self, name: str) -> Any:
        return getattr(self._enc, name)


def _guard_tekken(tok: Any) -> bool:
    """Puts `_GuardedEncoding` in front of the tekken tokenizer's encoding, where its
    pattern is proven to allow cutting (`guard.PATTERNS`) and it holds no special
    tokens; whether it did (else such text fails as `CountFailed`)."""
    tekken = getattr(getattr(tok, "instruct_tokenizer", None), "tokenizer", None)
    enc = getattr(tekken, "_model", None)
    try:
        import tiktoken
    except ImportError:  # pragma: no cover - mistral-common depends on it
        return False
    if tekken is None or not isinstance(enc, tiktoken.Encoding) or enc.special_tokens_set:
        return False
    cutter = run_cutter(enc)
    if cutter is None:
        return False
    tekken._model = _GuardedEncoding(enc, cutter)
    return True
