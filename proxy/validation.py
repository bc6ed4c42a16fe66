"""Parse and check a request body before anything counts or reserves (TGI's `validation`).

Only a `ValidRequest` reaches counting and admission, so a malformed request can
never hold capacity or reach a backend. Messages name the field and the value.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from proxy.errors import InvalidRequest
from proxy.json_slices import TooDeep, loads_sliced
from proxy.tokenize import ChatRequest

__all__ = ["MAX_JSON_DEPTH", "Endpoint", "ValidRequest", "parse_body", "parse_chat_file",
           "validate"]

_ROLES_NEED_CONTENT = {"system", "user", "developer"}

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects kvgate accepts. Real requests stay far below
(a tool schema with nested objects reaches about 10); deeper input is a 400, never a
RecursionError in the parser, the chat template or the re-serialisation."""

SLICED_CHARS = 64 * 1024
"""A longer text is parsed in short C calls (`proxy.json_slices`), the same JSON: one
`json.loads` of 4 MB holds the GIL, so the event loop, for up to 65 ms."""

# A \uD800-\uDFFF escape: only then can a string hold a surrogate (paired ones are fine).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class Endpoint(StrEnum):
    CHAT = "chat"
    COMPLETIONS = "completions"


@dataclass(frozen=True, slots=True, kw_only=True)
class ValidRequest:
    """A request whose shape is known good; `body` is the parsed JSON, untouched."""

    endpoint: Endpoint
    model: str
    stream: bool
    n: int
    max_tokens: int | None
    max_tokens_field: str
    n_predict: int | None  # llama.cpp's output bound; wins over max_tokens there, -1: none
    min_tokens: int  # vLLM's: EOS cannot end the answer before this many tokens
    ignore_eos: bool  # vLLM's: EOS never ends it, max_tokens does
    chat: ChatRequest | None
    prompts: tuple[str | tuple[int, ...], ...]
    body: Mapping[str, Any]

    def with_max_tokens(self, max_tokens: int) -> bytes:
        """The body to forward with the output capped at `max_tokens`. Every cap field the
        client gave is rewritten (a chat body may hold both `max_tokens` and
        `max_completion_tokens`, and an engine honours either; `n_predict` too, which
        llama.cpp honours first), else `max_tokens_field`."""
        present = [f for f in _MAX_TOKENS_FIELDS if self.body.get(f) is not None]
        fields = dict.fromkeys(present or [self.max_tokens_field], max_tokens)
        if self.n_predict is not None:  # llama.cpp reads it first: capped with the rest
            fields["n_predict"] = max_tokens
        # Compact and UTF-8 as is: `parse_body` has ruled out unencodable strings, and
        # ASCII escapes would grow non-Latin text up to six times on the wire.
        return json.dumps({**self.body, **fields}, ensure_ascii=False,
                          separators=(",", ":")).encode()


_MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens")


def _fail(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(message, param=param)


def _int_field(body: Mapping[str, Any], key: str, *, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise _fail(f"`{key}` must be an integer. Given: {json.dumps(value)}", key)
    if value < minimum:
        raise _fail(f"`{key}` must be >= {minimum}. Given: {value}", key)
    return value


def _messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise _fail("`messages` is required", "messages")
    if not isinstance(value, list):
        raise _fail("`messages` must be an array of message objects", "messages")
    if not value:
        raise _fail("`messages` must not be empty", "messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _fail(f"`{where}` must be an object", where)
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise _fail(f"`{where}.role` must be a non-empty string", f"{where}.role")
        content = message.get("content")
        if content is None:
            if role in _ROLES_NEED_CONTENT:
                raise _fail(f"`{where}.content` is required for role {role!r}", f"{where}.content")
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise _fail(
                        f"`{where}.content[{j}]` must be an object with a `type`",
                        f"{where}.content",
                    )
                if part["type"] == "text" and not isinstance(part.get("text"), str):
                    raise _fail(
                        f"`{where}.content[{j}].text` must be a string", f"{where}.content"
                    )
                if part["type"] != "text":
                    raise _fail(
                        f"`{where}.content[{j}]` has type {part['type']!r}; kvgate counts "
                        "text parts only",
                        f"{where}.content",
                    )
        elif not isinstance(content, str):
            raise _fail(f"`{where}.content` must be a string or an array of parts", where)
        calls = message.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise _fail(f"`{where}.tool_calls` must be an array", f"{where}.tool_calls")
        out.append(message)
    return out


def _optional_list_of_objects(body: Mapping[str, Any], key: str) -> list[dict[str, Any]] | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise _fail(f"`{key}` must be an array of objects", key)
    return value


def _chat(body: Mapping[str, Any], source_bytes: int = 0) -> ChatRequest:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise _fail("`chat_template_kwargs` must be an object", "chat_template_kwargs")
    add_gen = body.get("add_generation_prompt", True)
    if not isinstance(add_gen, bool):
        raise _fail("`add_generation_prompt` must be a boolean", "add_generation_prompt")
    cont = body.get("continue_final_message", False)
    if not isinstance(cont, bool):
        raise _fail("`continue_final_message` must be a boolean", "continue_final_message")
    if cont and add_gen:  # vLLM's own rule
        raise _fail("Cannot set both `continue_final_message` and `add_generation_prompt` to "
                    "True.", "continue_final_message")
    return ChatRequest(
        messages=_messages(body.get("messages")),
        tools=_optional_list_of_objects(body, "tools"),
        documents=_optional_list_of_objects(body, "documents"),
        add_generation_prompt=add_gen,
        template_kwargs=kwargs,
        continue_final_message=cont,
        source_bytes=source_bytes,
    )


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    )


def _prompts(value: Any) -> tuple[str | tuple[int, ...], ...]:
    """A string, strings, token ids, or lists of token ids (OpenAI's four shapes)."""
    if isinstance(value, str):
        return (value,)
    if _is_ids(value):
        return (tuple(value),)
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return tuple(value)
        if all(_is_ids(p) for p in value):
            return tuple(tuple(p) for p in value)
    if value is None:
        raise _fail("`prompt` is required", "prompt")
    raise _fail(
        "`prompt` must be a string, an array of strings, an array of token ids "
        "or an array of token-id arrays",
        "prompt",
    )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    """`1e400` is valid JSON text but overflows to inf, which re-serialises as `Infinity`
    (not JSON) when the body is rewritten, and means nothing to a sampler anyway."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of the range of a double")
    return value


def _decode(raw: bytes) -> tuple[str, bool]:
    """-> (text, may hold surrogates). JSON on the wire is UTF-8 (RFC 8259, section 8.1),
    and the backend gets these same bytes. CESU-8 style encoded surrogates decode here so
    the check below can name the field."""
    encoding = json.detect_encoding(raw)
    if encoding not in ("utf-8", "utf-8-sig"):
        raise _fail(f"request body must be UTF-8 encoded JSON; it looks like {encoding}",
                    "body")
    try:
        return raw.decode(encoding), False
    except UnicodeDecodeError:
        try:
            return raw.decode(encoding, "surrogatepass"), True
        except UnicodeDecodeError as exc:
            raise _fail(f"request body is not valid {encoding.upper()}: {exc}", "body") from exc


def _path(parent: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else key


def _too_deep(text: str, body: Any) -> bool:
    """Nesting deeper than `MAX_JSON_DEPTH`, from the parsed body: one iterative walk over
    its arrays and objects (strings are never scanned), after a count of the text's
    brackets rules out the common case at C speed."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return False  # too few brackets to nest that deep
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return True
        for child in value.values() if isinstance(value, dict) else value:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
    return False


def _check_strings(body: Any) -> None:
    """Lone UTF-16 surrogates (`"\\ud800"`, or CESU-8 bytes) parse as Python strings but
    are not Unicode text: no tokenizer can encode them (vLLM's fails on them too), and they
    cannot be written back as UTF-8 to the backend. Such a field is a 400 naming it.
    Iterative, over a body already known to be at most `MAX_JSON_DEPTH` deep."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, where = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in items:
            if isinstance(key, str) and not _encodable(key):
                raise _surrogate(_path(where, "<key>"), key)
            if isinstance(child, dict | list):
                stack.append((child, _path(where, key)))
            elif isinstance(child, str) and not _encodable(child):
                raise _surrogate(_path(where, key), child)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _surrogate(where: str, text: str) -> InvalidRequest:
    bad = next(c for c in text if 0xD800 <= ord(c) <= 0xDFFF)
    return _fail(
        f"`{where}` contains a lone UTF-16 surrogate (U+{ord(bad):04X}), which is not "
        "Unicode text: no tokenizer can encode it (vLLM's rejects it too). Encode the text "
        "as UTF-8, or escape a character outside the BMP as a surrogate pair",
        where,
    )


# One for every body, as `json.loads` keeps one: building it (its C scanner) per
# request was work on the request path; it holds no state between calls.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)


def parse_body(raw: bytes) -> Any:
    """JSON as kvgate accepts it: UTF-8 text, finite numbers only, at most `MAX_JSON_DEPTH`
    levels deep, every string encodable. Any other input is `InvalidRequest`, never an
    exception the server did not expect (a RecursionError, a 4300-digit integer)."""
    text, decoded_surrogates = _decode(raw)
    try:
        body = (_DECODER.decode(text) if len(text) <= SLICED_CHARS else
                loads_sliced(text, _DECODER, max_depth=MAX_JSON_DEPTH))
    except (RecursionError, TooDeep) as exc:
        raise _fail(
            f"request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels",
            "body",
        ) from exc
    except ValueError as exc:  # JSONDecodeError, NaN, 1e400, integers over the digit limit
        raise _fail(f"request body is not valid JSON: {exc}", "body") from exc
    if isinstance(body, dict | list) and _too_deep(text, body):
        raise _fail(
            f"request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels",
            "body",
        )
    if decoded_surrogates or _SURROGATE_ESCAPE.search(text) is not None:
        if isinstance(body, dict | list):
            _check_strings(body)
        elif isinstance(body, str) and not _encodable(body):
            raise _surrogate("body", body)
    return body


def validate(raw: bytes, endpoint: Endpoint) -> ValidRequest:
    """Parse a body; raise `InvalidRequest` naming the first bad field."""
    body = parse_body(raw)
    if not isinstance(body, dict):
        raise _fail("request body must be a JSON object", "body")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _fail("`model` is required and must be a non-empty string", "model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _fail(f"`stream` must be a boolean. Given: {json.dumps(stream)}", "stream")
    n = _int_field(body, "n", minimum=1) or 1
    ignore_eos = body.get("ignore_eos", False)
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise _fail(f"`ignore_eos` must be true or false. Given: {json.dumps(ignore_eos)}",
                    "ignore_eos")
    max_tokens = _int_field(body, "max_tokens", minimum=1)
    field = "max_tokens"
    if endpoint is Endpoint.CHAT:
        completion = _int_field(body, "max_completion_tokens", minimum=1)
        if completion is not None:
            if max_tokens is not None and max_tokens != completion:
                raise _fail(
                    "give `max_tokens` or `max_completion_tokens`, not two different values",
                    "max_completion_tokens",
                )
            max_tokens, field = completion, "max_completion_tokens"
    chat = endpoint is Endpoint.CHAT
    return ValidRequest(
        endpoint=endpoint,
        model=model,
        stream=stream,
        n=n,
        max_tokens=max_tokens,
        max_tokens_field=field,
        n_predict=_int_field(body, "n_predict", minimum=-1),
        min_tokens=_int_field(body, "min_tokens", minimum=0) or 0,
        ignore_eos=bool(ignore_eos),
        chat=_chat(body, source_bytes=len(raw)) if chat else None,
        prompts=() if chat else _prompts(body.get("prompt")),
        body=body,
    )


def parse_chat_file(data: Any) -> ChatRequest:
    """`kvgate count --chat FILE`: `{"messages": [...], "tools": [...]?, ...}`."""
    if not isinstance(data, dict):
        raise _fail("a chat file must hold a JSON object with `messages`", "messages")
    return _chat(data)
