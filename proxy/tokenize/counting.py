"""The counters: a chat or a prompt in, the engine's exact prompt-token count out.

Every count path (`count_chat`, `count_prompt`, `count_rendered_async` and the other
`_async` variants, inline or in the pool) gives the exact count or raises: a
tokenizer's own error, `TemplateError` for a chat the template refuses, or
`CountFailed` where the tokenizer library failed and nothing else could count (a Rust
panic, a `BaseException`, never escapes as one).
"""

from __future__ import annotations

import os
import threading
from array import array
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from typing import Any

import jinja2

from proxy.prefix_blocks import ID_BYTES, block_keys_of_bytes
from proxy.tokenize.base import (
    ChatRequest,
    Encoder,
    RenderedChat,
    TemplateError,
    TokenizerLoadError,
)
from proxy.tokenize.cache import DEFAULT_CACHE_BYTES, CacheStats, CountCache, SegmentCounter
from proxy.tokenize.fair_pool import FairPool
from proxy.tokenize.guard import CountFailed, is_panic
from proxy.tokenize.long_text import LongText, run_inline
from proxy.tokenize.templates import (
    ChatTemplate,
    ContentFormat,
    compile_template,
    content_format,
    parse_tool_call,
)

__all__ = ["Keyed", "TokenCounter", "count_executor", "count_pool"]

# Counting inline on the event loop beats a thread-pool round trip (a wake-up through
# the loop's self-pipe, two context switches) while the work is short: up to this
# many new characters (~0.5 ms with the fast encoder, ~3,600 English tokens) and this many
# messages to render. Longer work goes to the pool, where encoding runs without
# the GIL, so one huge prompt never stalls every other request.
INLINE_NEW_CHARS = 16_384
INLINE_MESSAGES = 64
# Splitting on added tokens and the cache lookups run before that decision, so a
# rendered prompt longer than this goes to the pool whole (about 0.1 ms of splitting
# for DeepSeek V3's 818 added tokens; a prompt of megabytes would hold the loop).
INLINE_RENDERED_CHARS = 65_536
# A chat from a body larger than this renders in the pool: its template may take long
# (the template serialises every tool; 4 MB of tools took seconds on the loop).
INLINE_BODY_BYTES = 65_536

# Block keys of at most this many tokens are hashed inline (~0.6 ms), longer in the pool.
INLINE_KEYED_TOKENS = 16_384

# A prompt's exact count and its shared-prefix block keys.
Keyed = tuple[int, tuple[str, ...]]


def _keyed(ids: bytes, block_tokens: int, scope: str) -> Keyed:
    """The count and block keys of ids held as `array("I")` bytes."""
    return len(ids) // ID_BYTES, tuple(block_keys_of_bytes(ids, block_tokens, scope=scope))


# What kvgate itself passes to a chat template; a request's template kwargs may not
# override them.
_REQUEST_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


class OffLoopCounter:
    """Counting is CPU-bound: the async variants run it in the shared thread pool."""

    def count_chat(self, chat: ChatRequest, limit: int | None = None) -> int:
        raise NotImplementedError

    def count_prompt(self, prompt: str | Sequence[int], limit: int | None = None) -> int:
        raise NotImplementedError

    async def count_chat_async(self, chat: ChatRequest, limit: int | None = None) -> int:
        return await count_pool().run(self.count_chat, chat)

    async def count_prompt_async(self, prompt: str | Sequence[int],
                                 limit: int | None = None) -> int:
        return await count_pool().run(self.count_prompt, prompt)


class TokenCounter(OffLoopCounter):
    """Counts prompt tokens for one model exactly; load once, share across requests."""

    def __init__(
        self,
        *,
        name: str,
        encoder: Encoder,
        chat_template: str | dict[str, str] | None,
        special_tokens: Mapping[str, str],
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        self.name = name
        self._encoder = encoder
        self._segments = SegmentCounter(
            split=encoder.split_rendered,
            encode=encoder.encode_segment,
            cache=CountCache(cache_bytes) if cache_bytes > 0 else None,
        )
        self._inline_chars = INLINE_NEW_CHARS if encoder.fast else INLINE_NEW_CHARS // 16
        self._long = LongText(encoder, self._segments, count_pool)
        self._templates: dict[str, str] = (
            chat_template
            if isinstance(chat_template, dict)
            else ({"default": chat_template} if chat_template else {})
        )
        self._compiled: dict[str, ChatTemplate] = {}
        self._special_tokens = dict(special_tokens)
        self._lock = threading.Lock()

    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    @property
    def encoder_description(self) -> str:
        """Which encoder counts for this model, and why (`kvgate check-config` shows it)."""
        return self._encoder.description

    @property
    def bound_description(self) -> str:
        """What admission on a bound uses for this model (`kvgate check-config`)."""
        return self._encoder.bound_description

    def cache_stats(self) -> CacheStats | None:
        cache = self._segments.cache
        return cache.stats() if cache is not None else None

    @cached_property
    def _joins_text_parts(self) -> bool:
        """vLLM detects the format of the template it renders with; kvgate, of every
        template the model names (they are one family's variants)."""
        return all(content_format(t) is ContentFormat.STRING for t in self._templates.values())

    def _template(self, *, tools: bool) -> ChatTemplate:
        if not self._templates:
            raise TemplateError(
                f"model {self.name!r} has no chat template; use /v1/completions with a prompt"
            )
        if tools and "tool_use" in self._templates:
            key = "tool_use"
        elif "default" in self._templates:
            key = "default"
        else:
            raise TokenizerLoadError(
                f"model {self.name!r} has named chat templates {sorted(self._templates)} "
                "and none called 'default'"
            )
        with self._lock:
            if key not in self._compiled:
                self._compiled[key] = compile_template(self._templates[key])
            return self._compiled[key]

    def normalize_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The engine's message preparation before rendering (vLLM's chat utils).

        Keys whose value is None are dropped (templates test for absence); string
        tool-call arguments are parsed to objects; for templates that expect string
        content, a list of text parts is joined with newlines.
        """
        out: list[dict[str, Any]] = []
        for message in messages:
            msg = {k: v for k, v in message.items() if v is not None}
            content = msg.get("content")
            if isinstance(content, list) and self._joins_text_parts:
                msg["content"] = "\n".join(
                    str(part.get("text", "")) for part in content if part.get("type") == "text"
                )
            calls = msg.get("tool_calls")
            if isinstance(calls, list):
                msg["tool_calls"] = [parse_tool_call(call) for call in calls]
            out.append(msg)
        return out

    def render_chat(self, chat: ChatRequest) -> str:
        if not chat.messages:
            raise TemplateError("`messages` must not be empty")
        template = self._template(tools=bool(chat.tools))
        extra = chat.template_kwargs or {}
        try:
            if _REQUEST_VARIABLES & extra.keys():
                raise TypeError(  # as apply_chat_template(**kwargs) would
                    f"template kwargs may not set {sorted(_REQUEST_VARIABLES & extra.keys())}")
            rendered = template.render({
                **self._special_tokens,
                **extra,
                "messages": self.normalize_messages(chat.messages),
                "tools": chat.tools,
                "documents": chat.documents,
                "add_generation_prompt": chat.add_generation_prompt,
            })
            if chat.continue_final_message:
                rendered = _continued(rendered, chat.messages[-1])
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateError(f"chat template rejected the request: {exc}") from exc
        except (TypeError, KeyError, AttributeError, IndexError, ValueError) as exc:
            raise TemplateError(
                f"chat template failed on these messages ({type(exc).__name__}: {exc})"
            ) from exc
        return rendered

    def chat_token_ids(self, chat: ChatRequest) -> list[int]:
        return self._encoder.encode_rendered(self.render_chat(chat))

    def prompt_token_ids(self, prompt: str) -> list[int]:
        """A completion prompt's ids, with the tokenizer's BOS rule (`count_prompt`'s)."""
        return self._encoder.encode_plain(prompt, add_special_tokens=True)

    def count_chat(self, chat: ChatRequest, limit: int | None = None) -> int:
        """In this thread (a count worker's, or a pool thread's): with a `limit`, long
        text as `count_chat_async` counts it, stopping once past the limit."""
        text = self.render_chat(chat)
        if limit is not None and len(text) > INLINE_RENDERED_CHARS:
            return run_inline(self._long.count_rendered(text, limit))
        return self._segments.count(text)

    async def count_chat_async(self, chat: ChatRequest, limit: int | None = None) -> int:
        """Short work inline, long work in the pool (see `INLINE_RENDERED_CHARS`)."""
        return await self._count_rendered(await self._rendered(chat), limit)

    def _renders_inline(self, chat: ChatRequest) -> bool:
        """A few messages from a small body: rendering takes well under a millisecond.
        A large body (4 MB of tools costs seconds in the template) renders in the pool."""
        return len(chat.messages) <= INLINE_MESSAGES and chat.source_bytes <= INLINE_BODY_BYTES

    async def _rendered(self, chat: ChatRequest) -> str:
        if self._renders_inline(chat):
            return self.render_chat(chat)
        return await count_pool().run(self.render_chat, chat)

    def render_for_count(self, chat: ChatRequest) -> RenderedChat | None:
        if not self._renders_inline(chat):
            return None  # rendered in the pool by `count_chat_async`
        text = self.render_chat(chat)
        return RenderedChat(text, self._encoder.max_rendered_tokens(text))

    async def count_rendered_async(self, rendered: RenderedChat,
                                   limit: int | None = None) -> int:
        return await self._count_rendered(rendered.text, limit)

    async def _count_rendered(self, rendered: str, limit: int | None = None) -> int:
        if len(rendered) > INLINE_RENDERED_CHARS:
            return await self._long.run(self._long.count_rendered(rendered, limit))
        known, todo = self._segments.plan(rendered)
        if sum(map(len, todo)) <= self._inline_chars:
            return known + self._segments.finish(todo)
        return known + await count_pool().run(self._segments.finish, todo)

    async def count_prompt_async(self, prompt: str | Sequence[int],
                                 limit: int | None = None) -> int:
        if not isinstance(prompt, str) or len(prompt) <= self._inline_chars:
            return self.count_prompt(prompt)
        if len(prompt) > INLINE_RENDERED_CHARS:
            return await self._long.run(self._long.count_plain(prompt, limit,
                                                               self.count_prompt))
        return await super().count_prompt_async(prompt)

    def count_prompt(self, prompt: str | Sequence[int], limit: int | None = None) -> int:
        """One completion prompt: text gets the tokenizer's BOS rule, ids count as given;
        with a `limit`, long text stops once past it (as `count_chat`)."""
        if isinstance(prompt, str):
            if limit is not None and len(prompt) > INLINE_RENDERED_CHARS:
                return run_inline(self._long.count_plain(prompt, limit, self.count_prompt))
            return len(self._plain_ids(prompt))
        return len(prompt)

    def _plain_ids(self, prompt: str) -> list[int]:
        try:
            return self._encoder.encode_plain(prompt, add_special_tokens=True)
        except BaseException as exc:  # the encoders catch theirs: this is the last net
            if is_panic(exc):
                raise CountFailed(f"model {self.name!r}: the tokenizer panicked on a "
                                  f"prompt of {len(prompt)} characters: {exc}") from exc
            raise

    # ------------------------------------------------------------ with block keys
    # The exact count and the prompt's shared-prefix block keys (`proxy.prefix_blocks`)
    # from one id stream: a chat's from its segments' cached ids (`SegmentCounter.ids`),
    # a prompt's from `encode_plain`. Failures are those of `count_chat`/`count_prompt`.

    def count_chat_keys(self, chat: ChatRequest, block_tokens: int, scope: str,
                        limit: int | None = None) -> Keyed:
        text = self.render_chat(chat)
        if limit is not None and len(text) > INLINE_RENDERED_CHARS:
            return run_inline(self._long.keys_rendered(text, block_tokens, scope, limit))
        return self._segments.keys(text, block_tokens, scope)

    def count_prompt_keys(self, prompt: str | Sequence[int], block_tokens: int,
                          scope: str, limit: int | None = None) -> Keyed:
        if isinstance(prompt, str) and limit is not None and len(prompt) > INLINE_RENDERED_CHARS:
            return run_inline(self._long.keys_plain(prompt, block_tokens, scope, limit,
                                                    self._plain_ids))
        ids = self._plain_ids(prompt) if isinstance(prompt, str) else prompt
        try:
            data = array("I", ids).tobytes()
        except OverflowError:  # an id no vocabulary has (>= 2**32): nothing to share
            return len(ids), ()
        return _keyed(data, block_tokens, scope)

    async def count_chat_keys_async(self, chat: ChatRequest, block_tokens: int,
                                    scope: str, limit: int | None = None) -> Keyed:
        """`count_chat_keys`: inline where little is new (what `count_chat_async` does
        inline, and the keys of at most `INLINE_KEYED_TOKENS`), else in the pool."""
        rendered = await self._rendered(chat)
        segments = self._segments
        if len(rendered) > INLINE_RENDERED_CHARS:
            return await self._long.run(self._long.keys_rendered(rendered, block_tokens,
                                                                 scope, limit))
        parts, size = segments.plan_ids(rendered)
        new_chars = sum(len(p) for p in parts if isinstance(p, str))
        if new_chars <= self._inline_chars and size <= INLINE_KEYED_TOKENS:
            return segments.finish_keys(parts, block_tokens, scope)
        return await count_pool().run(segments.finish_keys, parts,
                                          block_tokens, scope)

    async def count_prompt_keys_async(self, prompt: str | Sequence[int], block_tokens: int,
                                      scope: str, limit: int | None = None) -> Keyed:
        if len(prompt) <= (self._inline_chars if isinstance(prompt, str)
                           else INLINE_KEYED_TOKENS):
            return self.count_prompt_keys(prompt, block_tokens, scope)
        if isinstance(prompt, str) and len(prompt) > INLINE_RENDERED_CHARS:
            return await self._long.run(self._long.keys_plain(prompt, block_tokens, scope,
                                                              limit, self._plain_ids))
        return await count_pool().run(self.count_prompt_keys, prompt,
                                          block_tokens, scope)

    def token_id(self, token: str) -> int | None:
        return self._encoder.token_id(token)


_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()
_pool: FairPool | None = None


def count_pool() -> FairPool:
    """The count pool as every count path uses it: the executor's threads, taken in
    turn by tenant (`proxy.tokenize.fair_pool`)."""
    global _pool
    with _executor_lock:
        if _pool is None:
            _pool = FairPool(count_executor, max(1, os.cpu_count() or 1))
        return _pool


def count_executor() -> ThreadPoolExecutor:
    """One pool for all counting, sized to the cores: encoding releases the GIL."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(
                max_workers=max(1, os.cpu_count() or 1), thread_name_prefix="kvgate-count"
            )
        return _executor


def _continued(rendered: str, final: Mapping[str, Any]) -> str:
    """The rendered chat cut right after the final message's text, as transformers'
    `continue_final_message` cuts it (the end of its turn goes, so the model goes on)."""
    content = final.get("content")
    if isinstance(content, list):
        content = next((part["text"] for part in reversed(content)
                        if isinstance(part, Mapping) and isinstance(part.get("text"), str)),
                       None)
    if not isinstance(content, str) or not content.strip():
        raise ValueError("continue_final_message needs a final message with text")
    at = rendered.rfind(content.strip())
    if at < 0:
        raise ValueError("the final message does not appear in the rendered chat")
    kept = len(content.lstrip())
    if rendered[at:at + kept] != content.lstrip():
        kept = len(content.strip())  # the template does not keep its trailing spacing
    return rendered[:at + kept]
