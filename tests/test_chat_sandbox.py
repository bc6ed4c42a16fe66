"""The chat-template sandbox's short paths answer exactly as jinja's own sandbox.

`_ChatSandbox` answers dict, str, loop and namespace lookups without the general
sandbox path; every probe below renders through it and through an unmodified
`ImmutableSandboxedEnvironment` (configured the same) and must give the same text,
or the same error when the sandbox refuses.
"""

from __future__ import annotations

from typing import Any

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from proxy.tokenize import templates

MESSAGES = [
    {"role": "system", "content": "Be brief. {0} {name}"},
    {"role": "user", "content": "  Hi <think>x</think> there  ", "items": "an item key"},
]

PROBES = [
    # dict items read as attributes, present and absent
    "{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}",
    "{{ messages[0].missing is defined }}-{{ messages[0].missing }}-"
    "{{ messages[1].items is callable }}",
    "{{ messages[1].items() | list | length }}{{ messages[0].get('role') }}",
    "{{ messages[0].keys() | list }}{{ messages[0].content is string }}",
    # str methods, the format pair (sandboxed formatting) and private names
    "{{ messages[1].content.strip().split('</think>')[-1].lstrip() }}",
    "{{ messages[1].content.startswith('  Hi') }}{{ messages[0].content.upper() }}",
    "{{ messages[0].content.format('a', name='b') }}",
    "{{ messages[0].content.format_map({'name': 'x'}) if false else 'skip' }}",
    "{{ messages[0].content.nope }}|{{ messages[0].content.nope is defined }}",
    "{{ ''.__class__ }}",
    "{{ ''.__class__.__mro__ }}",
    "{{ '{0.__class__}'.format('x') }}",
    "{{ messages[0].content._private }}",
    # dict dunder and mutation
    "{{ messages[0].__class__ }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ messages.append(1) }}",
    "{{ messages[0].pop('role') }}",
    # loop and namespace
    "{% for m in messages %}{{ loop.index0 }}{{ loop.first }}{{ loop.last }}"
    "{{ loop.length }}{{ loop.revindex }}{{ loop.nope }}{% endfor %}",
    "{% for m in messages %}{{ loop._after }}{% endfor %}",
    "{% for m in messages %}{{ loop.cycle('a', 'b') }}{% endfor %}",
    "{% set ns = namespace(flag=false, n=0) %}{% for m in messages %}"
    "{% set ns.n = ns.n + 1 %}{% if m.role == 'user' %}{% set ns.flag = true %}{% endif %}"
    "{% endfor %}{{ ns.flag }}{{ ns.n }}{{ ns.missing is defined }}",
    "{% set ns = namespace(a=1) %}{{ ns.__class__ }}",
    "{% set ns = namespace(a=1) %}{{ ns._Namespace__attrs }}",
]


def _reference() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[templates._GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = templates._tojson
    env.globals["raise_exception"] = templates._raise_exception
    env.globals["namespace"] = templates._SafeNamespace
    return env


def _outcome(render: Any) -> tuple[str, str]:
    try:
        return "ok", str(render())
    except Exception as exc:  # the comparison is the point: same type, same message
        return type(exc).__name__, str(exc)


@pytest.mark.parametrize("source", PROBES)
def test_short_paths_answer_as_the_sandbox(source: str) -> None:
    fast = templates.compile_template(source)
    reference = _reference().from_string(source)
    assert isinstance(fast._template.environment, templates._ChatSandbox)
    got = _outcome(lambda: fast.render({"messages": [dict(m) for m in MESSAGES]}))
    want = _outcome(lambda: reference.render(messages=[dict(m) for m in MESSAGES]))
    assert got == want


def test_the_sandbox_still_refuses() -> None:
    """Not only equal to the reference: the unsafe probes are refused by both."""
    for source in ("{{ messages.append(1) }}", "{{ messages[0].update({'a': 1}) }}"):
        with pytest.raises(SecurityError):
            templates.compile_template(source).render({"messages": [dict(MESSAGES[0])]})
    for source in ("{{ ''.__class__ }}", "{{ messages[0].__class__ }}",
                   "{{ messages[0].content._private }}", "{{ '{0.__class__}'.format('x') }}",
                   "{% set ns = namespace(a=1) %}{{ ns._Namespace__attrs }}"):
        assert templates.compile_template(source).render({"messages": MESSAGES}) == ""
