"""Parse and check a request body before anything counts or reserves (TGI's `validation`).

Only a `ValidRequest` reaches counting and admission, so a malformed request can
never hold capacity or reach a backend. Messages name the field and the value.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from proxy.errors import InvalidRequest
from proxy.tokenize import ChatRequest

__all__ = ["Endpoint", "ValidRequest", "parse_chat_file", "validate"]

_ROLES_NEED_CONTENT = {"system", "user", "developer"}


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
    chat: ChatRequest | None
    prompts: tuple[str | tuple[int, ...], ...]
    body: Mapping[str, Any]


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


def _chat(body: Mapping[str, Any]) -> ChatRequest:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise _fail("`chat_template_kwargs` must be an object", "chat_template_kwargs")
    add_gen = body.get("add_generation_prompt", True)
    if not isinstance(add_gen, bool):
        raise _fail("`add_generation_prompt` must be a boolean", "add_generation_prompt")
    return ChatRequest(
        messages=_messages(body.get("messages")),
        tools=_optional_list_of_objects(body, "tools"),
        documents=_optional_list_of_objects(body, "documents"),
        add_generation_prompt=add_gen,
        template_kwargs=kwargs,
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


def validate(raw: bytes, endpoint: Endpoint) -> ValidRequest:
    """Parse a body; raise `InvalidRequest` naming the first bad field."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _fail(f"request body is not valid JSON: {exc}", "body") from exc
    if not isinstance(body, dict):
        raise _fail("request body must be a JSON object", "body")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _fail("`model` is required and must be a non-empty string", "model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _fail(f"`stream` must be a boolean. Given: {json.dumps(stream)}", "stream")
    n = _int_field(body, "n", minimum=1) or 1
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
        chat=_chat(body) if chat else None,
        prompts=() if chat else _prompts(body.get("prompt")),
        body=body,
    )


def parse_chat_file(data: Any) -> ChatRequest:
    """`kvgate count --chat FILE`: `{"messages": [...], "tools": [...]?, ...}`."""
    if not isinstance(data, dict):
        raise _fail("a chat file must hold a JSON object with `messages`", "messages")
    return _chat(data)
