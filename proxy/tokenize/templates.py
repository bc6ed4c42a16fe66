"""Chat templates rendered with the semantics of transformers' `apply_chat_template`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.runtime import LoopContext, new_context
from jinja2.sandbox import ImmutableSandboxedEnvironment

from proxy.tokenize.base import TokenizerLoadError

__all__ = ["ChatTemplate", "ContentFormat", "compile_template", "content_format",
           "parse_tool_call", "read_chat_template", "read_json", "special_token_text"]


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


# What `getattr` finds on a plain dict or str without reading its items: the
# attributes of the type itself (an instance of either has no `__dict__`).
_DICT_ATTRIBUTES = frozenset(dir(dict))
_STR_FORMATTERS = frozenset({"format", "format_map"})
_PLAIN_TYPES = frozenset({str, LoopContext, _SafeNamespace})


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox with a short way through the commonest lookups.

    Chat templates read `message.role` and `message.content` on plain dicts, call
    methods such as `content.strip()` on plain strings, and read `loop.first` and
    `ns.flag`. The sandbox's general `getattr` tries the attribute first, so every
    `message.role` raises and catches an AttributeError before reading the item,
    and every other lookup passes the safety checks (a chain of isinstance tests)
    one by one: a fifth to a third of a short chat's render time. For exactly these
    types the general path's answer is known in advance (a dict attribute that is
    not a dict method is its item; the public attributes of a string, a loop and a
    template namespace are safe, the string's format pair aside), so it is given
    directly; everything else, `str.format` included, takes the sandbox's own path.
    """

    def getattr(self, obj: Any, attribute: str) -> Any:
        kind = type(obj)
        if kind is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return self.undefined(obj=obj, name=attribute)
        if (kind in _PLAIN_TYPES and not attribute.startswith("_")
                and (kind is not str or attribute not in _STR_FORMATTERS)):
            try:
                return getattr(obj, attribute)
            except AttributeError:
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)


def _environment() -> ImmutableSandboxedEnvironment:
    env = _ChatSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    return env


def compile_template(template: str) -> ChatTemplate:
    try:
        return ChatTemplate(_environment().from_string(template))
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise TokenizerLoadError(f"chat template does not compile: {exc}") from exc


class ContentFormat(StrEnum):
    """How a template reads `message['content']` (vLLM's "chat template content format").

    OPENAI templates loop over the content themselves and get the list of parts as
    sent; STRING templates expect a string, and vLLM joins text parts with "\n".
    """

    STRING = "string"
    OPENAI = "openai"


def _is_name(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _is_key(node: nodes.Node, name: str, key: str) -> bool:
    """`name['key']` or `name.key`."""
    if isinstance(node, nodes.Getitem):
        return (_is_name(node.node, name) and isinstance(node.arg, nodes.Const)
                and node.arg.value == key)
    if isinstance(node, nodes.Getattr):
        return _is_name(node.node, name) and node.attr == key
    return False


def _reads(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """`node` is `name` (or `name[key]`), maybe filtered, tested or sliced:
    `messages | reverse`, `messages[1:]`, `message['content'] | list` all count."""
    if isinstance(node, (nodes.Filter, nodes.Test)):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, name, key)
    return _is_key(node, name, key) if key is not None else _is_name(node, name)


def _aliases(root: nodes.Template, name: str) -> list[str]:
    """`name` and every variable set from it, transitively
    (`{% set loop_messages = messages[1:] %}` makes `loop_messages` one)."""
    found = [name]
    todo = [name]
    while todo:
        current = todo.pop()
        for assign in root.find_all(nodes.Assign):
            target = assign.target
            if (isinstance(target, nodes.Name) and target.name not in found
                    and _reads(assign.node, current)):
                found.append(target.name)
                todo.append(target.name)
    return found


def _loop_targets(root: nodes.Template, sources: list[str], key: str | None) -> list[str]:
    """Names bound by `{% for x in s %}` (or `in s[key]`) for any `s` in `sources`."""
    out = []
    for loop in root.find_all(nodes.For):
        if isinstance(loop.target, nodes.Name) and any(
                _reads(loop.iter, source, key) for source in sources):
            out.append(loop.target.name)
    return out


def content_format(template: str) -> ContentFormat:
    """Detect the content format from the template's syntax tree, as vLLM does.

    OPENAI when some loop walks the content of a message taken from `messages`:
    `{% for message in loop_messages %}...{% for item in message['content'] %}`
    (Gemma 3). A text search misses the subscript and filter forms; the tree does not.
    A template that does not parse counts as STRING, vLLM's fallback.
    """
    try:
        root = _environment().parse(template)
    except jinja2.exceptions.TemplateSyntaxError:
        return ContentFormat.STRING
    messages = _aliases(root, "messages")
    message_names = _loop_targets(root, messages, None)
    if _loop_targets(root, message_names, "content"):
        return ContentFormat.OPENAI
    return ContentFormat.STRING


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

