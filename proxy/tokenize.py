"""Exact prompt-token counts, as the serving engine will count them.

Admission is only as good as its count: low by 5% overcommits the GPU, high wastes
it. So the count follows the engine's path, not an estimate:

* chat requests: render the model's own chat template with the semantics of
  transformers' `apply_chat_template` (what vLLM and SGLang call), then encode the
  text *without* adding special tokens again (the template writes BOS itself);
* plain prompts (`/v1/completions`): encode with the tokenizer's own BOS rule;
  token-id prompts count as given.

Loading happens once per model; `count_*` are synchronous and CPU-bound, and the
server runs them in a thread pool (`TokenCounter.count_chat_async`).

Import as `proxy.tokenize`: the module name shadows the stdlib's `tokenize` only
for code run from inside `proxy/`.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "ChatRequest",
    "MistralTokenCounter",
    "PromptCounter",
    "TemplateError",
    "TokenCounter",
    "TokenizerLoadError",
    "count_executor",
    "load_counter",
]


class TokenizerLoadError(ValueError):
    """A model directory cannot give an exact count (no tokenizer, unsupported format)."""


class TemplateError(ValueError):
    """The chat template refused the messages; its own message is passed through."""


class _Encoder(Protocol):
    def encode_plain(self, text: str, *, add_special_tokens: bool) -> list[int]: ...
    def encode_rendered(self, text: str) -> list[int]: ...
    def token_id(self, token: str) -> int | None: ...


# --------------------------------------------------------------------------- encoders


class _HFEncoder:
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


class _TiktokenEncoder:
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


# --------------------------------------------------------------------------- templates


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers overrides jinja's tojson: no HTML escaping, json.dumps defaults.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (assistant-mask marker)."""

    tags = {"generation"}  # noqa: RUF012 - jinja's own attribute

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(
            lineno
        )

    def _render(self, caller: Any) -> str:
        rendered: str = caller()
        return rendered


class _SafeNamespace(jinja2.utils.Namespace):
    """Namespaces refuse underscore names, as transformers' sandbox does."""

    def __setitem__(self, name: str, value: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes, got {name!r}"
            )
        super().__setitem__(name, value)


def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise TokenizerLoadError(f"chat template does not compile: {exc}") from exc


# A template that loops over a message's content reads OpenAI-style parts itself;
# others expect a string, and vLLM joins text parts with "\n" for them.
_PARTS_LOOP = re.compile(r"for\s+\w+\s+in\s+\w+(?:\[['\"]content['\"]\]|\.content)\b")


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatRequest:
    """What a chat template sees: the request's messages and options, validated."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    template_kwargs: Mapping[str, Any] | None = None


def _special_token_text(value: Any) -> str | None:
    """`bos_token` may be a string or an AddedToken dict (`{"content": ...}`)."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


class PromptCounter(Protocol):
    """What the request path needs from a model's tokenizer."""

    name: str

    @property
    def has_chat_template(self) -> bool: ...

    def count_chat(self, chat: ChatRequest) -> int: ...

    def count_prompt(self, prompt: str | Sequence[int]) -> int: ...

    async def count_chat_async(self, chat: ChatRequest) -> int: ...

    async def count_prompt_async(self, prompt: str | Sequence[int]) -> int: ...


class _OffLoop:
    """Counting is CPU-bound: the async variants run it in the shared thread pool."""

    def count_chat(self, chat: ChatRequest) -> int:
        raise NotImplementedError

    def count_prompt(self, prompt: str | Sequence[int]) -> int:
        raise NotImplementedError

    async def count_chat_async(self, chat: ChatRequest) -> int:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(count_executor(), self.count_chat, chat)

    async def count_prompt_async(self, prompt: str | Sequence[int]) -> int:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(count_executor(), self.count_prompt, prompt)


class TokenCounter(_OffLoop):
    """Counts prompt tokens for one model exactly; load once, share across requests."""

    def __init__(
        self,
        *,
        name: str,
        encoder: _Encoder,
        chat_template: str | dict[str, str] | None,
        special_tokens: Mapping[str, str],
    ) -> None:
        self.name = name
        self._encoder = encoder
        self._templates: dict[str, str] = (
            chat_template
            if isinstance(chat_template, dict)
            else ({"default": chat_template} if chat_template else {})
        )
        self._compiled: dict[str, jinja2.Template] = {}
        self._special_tokens = dict(special_tokens)
        self._lock = threading.Lock()

    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    @cached_property
    def _joins_text_parts(self) -> bool:
        return not any(_PARTS_LOOP.search(t) for t in self._templates.values())

    def _template(self, *, tools: bool) -> jinja2.Template:
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
                self._compiled[key] = _compile(self._templates[key])
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
                msg["tool_calls"] = [_parse_tool_call(call) for call in calls]
            out.append(msg)
        return out

    def render_chat(self, chat: ChatRequest) -> str:
        if not chat.messages:
            raise TemplateError("`messages` must not be empty")
        template = self._template(tools=bool(chat.tools))
        variables: dict[str, Any] = {**self._special_tokens, **(chat.template_kwargs or {})}
        try:
            rendered: str = template.render(
                messages=self.normalize_messages(chat.messages),
                tools=chat.tools,
                documents=chat.documents,
                add_generation_prompt=chat.add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateError(f"chat template rejected the request: {exc}") from exc
        except (TypeError, KeyError, AttributeError, IndexError, ValueError) as exc:
            raise TemplateError(
                f"chat template failed on these messages ({type(exc).__name__}: {exc})"
            ) from exc
        return rendered

    def chat_token_ids(self, chat: ChatRequest) -> list[int]:
        return self._encoder.encode_rendered(self.render_chat(chat))

    def count_chat(self, chat: ChatRequest) -> int:
        return len(self.chat_token_ids(chat))

    def count_prompt(self, prompt: str | Sequence[int]) -> int:
        """One completion prompt: text gets the tokenizer's BOS rule, ids count as given."""
        if isinstance(prompt, str):
            return len(self._encoder.encode_plain(prompt, add_special_tokens=True))
        return len(prompt)

    def token_id(self, token: str) -> int | None:
        return self._encoder.token_id(token)


class MistralTokenCounter(_OffLoop):
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

    @property
    def has_chat_template(self) -> bool:
        return True

    def count_chat(self, chat: ChatRequest) -> int:
        from mistral_common.exceptions import MistralCommonException
        from mistral_common.protocol.instruct.request import ChatCompletionRequest
        from pydantic import ValidationError

        if not chat.messages:
            raise TemplateError("`messages` must not be empty")
        messages = [{k: v for k, v in m.items() if v is not None} for m in chat.messages]
        try:
            request = ChatCompletionRequest.from_openai(messages=messages, tools=chat.tools)
            tokens: list[int] = self._tok.encode_chat_completion(request).tokens
        except (MistralCommonException, ValidationError, ValueError, TypeError) as exc:
            raise TemplateError(f"Mistral request encoder rejected the request: {exc}") from exc
        return len(tokens)

    def count_prompt(self, prompt: str | Sequence[int]) -> int:
        if isinstance(prompt, str):
            ids: list[int] = self._tok.instruct_tokenizer.tokenizer.encode(
                prompt, bos=True, eos=False
            )
            return len(ids)
        return len(prompt)


def _parse_tool_call(call: Any) -> Any:
    if not isinstance(call, Mapping):
        return call
    fn = call.get("function")
    if isinstance(fn, Mapping) and isinstance(fn.get("arguments"), str):
        try:
            args = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            return dict(call)
        return {**call, "function": {**fn, "arguments": args}}
    return dict(call)


_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def count_executor() -> ThreadPoolExecutor:
    """One pool for all counting, sized to the cores: encoding releases the GIL."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(
                max_workers=max(1, os.cpu_count() or 1), thread_name_prefix="kvgate-count"
            )
        return _executor


# --------------------------------------------------------------------------- loading


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TokenizerLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerLoadError(f"{path} must hold a JSON object")
    return data


def _chat_template(model_dir: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """`chat_template.jinja` > `chat_template.json` > tokenizer_config's `chat_template`."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = model_dir / "chat_template.json"
    if json_file.is_file():
        value = _read_json(json_file).get("chat_template")
    else:
        value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {}
        for item in value:
            if not (isinstance(item, Mapping) and "name" in item and "template" in item):
                raise TokenizerLoadError(
                    "`chat_template` list entries must be {'name': ..., 'template': ...}"
                )
            named[str(item["name"])] = str(item["template"])
        return named
    raise TokenizerLoadError(f"`chat_template` must be a string or a list; got {type(value)}")


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
            encoder=_TiktokenEncoder(encoding, None),
            chat_template=None,
            special_tokens={},
        )
    path = Path(model_dir)
    if not path.is_dir():
        raise TokenizerLoadError(f"model directory {str(path)!r} does not exist")
    config_file = path / "tokenizer_config.json"
    config = _read_json(config_file) if config_file.is_file() else {}
    template = _chat_template(path, config)
    special = {
        key: text
        for key in ("bos_token", "eos_token", "unk_token", "pad_token")
        if (text := _special_token_text(config.get(key))) is not None
    }
    label = name or path.name
    if (path / "tokenizer.json").is_file():
        add_bos = config.get("add_bos_token")
        if config.get("tokenizer_class") not in ("LlamaTokenizerFast", "LlamaTokenizer"):
            add_bos = None  # only Llama-style tokenizers rebuild BOS from the config
        encoder: _Encoder = _HFEncoder(
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
                encoder=_TiktokenEncoder(candidate, rank_file),
                chat_template=template,
                special_tokens=special,
            )
    if (path / "tekken.json").is_file():
        return MistralTokenCounter(path / "tekken.json", name=label)
    raise TokenizerLoadError(
        f"{path} has no tokenizer: expected tokenizer.json or a <encoding>.tiktoken file"
    )
