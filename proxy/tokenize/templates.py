"""Chat templates rendered with the semantics of transformers' `apply_chat_template`."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.runtime import new_context
from jinja2.sandbox import ImmutableSandboxedEnvironment

from proxy.tokenize.base import TokenizerLoadError

__all__ = ["PARTS_LOOP", "ChatTemplate", "compile_template", "parse_tool_call",
           "read_chat_template", "read_json", "special_token_text"]


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


class ChatTemplate:
    """A compiled chat template that renders with its globals merged once.

    `jinja2.Template.render` copies the environment's globals (a ChainMap) into a
    fresh context on every call, a fifth of a short chat's render time. Here the
    globals are flattened at compile time and the context shares the per-call dict,
    which templates cannot modify anyway. Output is identical.
    """

    def __init__(self, template: jinja2.Template) -> None:
        self._template = template
        self._globals = dict(template.globals)

    def render(self, variables: Mapping[str, Any]) -> str:
        t = self._template
        context = new_context(t.environment, t.name, t.blocks,
                              {**self._globals, **variables}, True, None, None)
        rendered: str = t.environment.concat(t.root_render_func(context))
        return rendered


def compile_template(template: str) -> ChatTemplate:
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
        return ChatTemplate(env.from_string(template))
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise TokenizerLoadError(f"chat template does not compile: {exc}") from exc


# A template that loops over a message's content reads OpenAI-style parts itself;
# others expect a string, and vLLM joins text parts with "\n" for them.
PARTS_LOOP = re.compile(r"for\s+\w+\s+in\s+\w+(?:\[['\"]content['\"]\]|\.content)\b")


def special_token_text(value: Any) -> str | None:
    """`bos_token` may be a string or an AddedToken dict (`{"content": ...}`)."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def parse_tool_call(call: Any) -> Any:
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


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TokenizerLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerLoadError(f"{path} must hold a JSON object")
    return data


def read_chat_template(model_dir: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """`chat_template.jinja` > `chat_template.json` > tokenizer_config's `chat_template`."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = model_dir / "chat_template.json"
    if json_file.is_file():
        value = read_json(json_file).get("chat_template")
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

