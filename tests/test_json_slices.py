"""`proxy.json_slices.loads_sliced`: the value and the error `json.loads` gives, from
short C calls.

Equality is checked against `json.loads` itself, with the hooks kvgate parses with, on
generated JSON (valid, and broken at a random place) with windows small enough that
every path (whole windows, runs, the walk one level down) is taken; and on bodies of
the shapes the hostile-client benchmark sends, at full window size.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.bench_hostile import attack_body
from proxy import json_slices
from proxy.errors import InvalidRequest
from proxy.json_slices import TooDeep, loads_sliced
from proxy.validation import (
    MAX_JSON_DEPTH,
    SLICED_CHARS,
    Endpoint,
    _finite_float,
    _reject_constant,
    parse_body,
    validate,
)


def _decoder() -> json.JSONDecoder:
    return json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)


def outcome(parse: Any, text: str) -> tuple[str, Any]:
    try:
        return "value", parse(text)
    except json.JSONDecodeError as exc:
        return "JSONDecodeError", (exc.msg, exc.pos)
    except (RecursionError, TooDeep):
        return "deep", None
    except ValueError as exc:  # the hooks: 1e400, NaN
        return "ValueError", str(exc)


def reference(text: str) -> tuple[str, Any]:
    return outcome(lambda t: json.loads(t, parse_constant=_reject_constant,
                                        parse_float=_finite_float), text)


def sliced(text: str) -> tuple[str, Any]:
    return outcome(lambda t: loads_sliced(t, _decoder(), max_depth=MAX_JSON_DEPTH), text)


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-10**20, 10**20),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(alphabet=st.sampled_from('ab,:]}[{" \\\u00e9\U0001f642'), max_size=12),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=12) | st.dictionaries(
        st.text(alphabet=st.sampled_from('ab,:]}"'), max_size=4), inner, max_size=8),
    max_leaves=60,
)
BREAKS = ["", ",", "]", "}", "[", "{", '"', " ", "x", "1e400", "NaN", ":", "\\", "\n"]


@settings(max_examples=400, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # one patch for all
@given(value=values, layout=st.sampled_from([None, 1, "compact", "spaced"]),
       cut=st.floats(0, 1), insert=st.sampled_from(BREAKS), drop=st.integers(0, 2),
       broken=st.booleans())
def test_the_same_value_or_error_as_json_loads(
    monkeypatch: pytest.MonkeyPatch, value: Any, layout: Any, cut: float, insert: str,
    drop: int, broken: bool,
) -> None:
    monkeypatch.setattr(json_slices, "WINDOW", 48)  # every path, on small texts
    if layout == "compact":
        text = json.dumps(value, separators=(",", ":"))
    elif layout == "spaced":
        text = json.dumps(value, separators=(" , ", " : "))
    else:
        text = json.dumps(value, indent=layout)
    if broken:
        at = int(cut * len(text))
        text = text[:at] + insert + text[at + drop:]
    assert sliced(text) == reference(text)


def test_edges_are_the_same_as_json_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(json_slices, "WINDOW", 16)
    texts = ["", " ", "[", "{", "[]", "{}", " [ ] ", "[1,]", '{"a":1,}', '{"a" 1}',
             '{"a":1 "b":2}', "[1 2]", '["' + "x" * 100 + '"', "[" + "1," * 40 + "1]",
             '{"k":' + '"v",' * 3 + "}", "[" + '"a",' * 30 + "]", "[1] x", "\ufeff[1]",
             '{"a":' + "[" * 20 + "]" * 20 + "}", "[" + "1e400," * 10 + "1]",
             '{"a":1,"a":2,' + '"b":3,' * 20 + '"a":4}', "[-]", "[tru]", '"\\ud800"']
    for text in texts:
        assert sliced(text) == reference(text), text


def test_deep_nesting_is_refused_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """Containers walked (too long for a window) deeper than the limit are `TooDeep`;
    a deep body ends in the one refusal whichever way it was parsed."""
    monkeypatch.setattr(json_slices, "WINDOW", 16)
    deep = MAX_JSON_DEPTH + 5
    text = ('["' + "x" * 40 + '",') * deep + "1" + "]" * deep
    assert sliced(text) == ("deep", None)
    assert reference(text)[0] == "value"  # json.loads takes it; parse_body then refuses
    monkeypatch.undo()
    for raw in ("[" * deep + " " * SLICED_CHARS + "]" * deep,  # walked: TooDeep
                "[" * deep + "]" * deep + " " * SLICED_CHARS,  # one window: the depth check
                "[" * 2000 + "]" * 2000 + " " * SLICED_CHARS):  # past the C recursion limit
        with pytest.raises(InvalidRequest, match="deeper than 64 levels"):
            parse_body(raw.encode())


@pytest.mark.parametrize("kind", ["unique-text", "spaces", "many-prompts", "tools"])
def test_the_benchmarks_worst_bodies_parse_the_same_in_short_calls(kind: str) -> None:
    """At full size, and no C call reads a container longer than a window: the C
    scanner gets the whole text only at a string or a number (read at memory speed)."""
    import random

    raw = attack_body(kind, random.Random(0))
    text = raw.decode()
    assert len(text) > SLICED_CHARS
    calls: list[tuple[int, str, int]] = []
    decoder = _decoder()
    scan = json.scanner.make_scanner(decoder)  # type: ignore[arg-type]

    def spy(string: str, idx: int) -> tuple[Any, int]:
        calls.append((len(string), string[idx:idx + 1], idx))
        return scan(string, idx)  # type: ignore[no-any-return]

    original = json.scanner.make_scanner
    try:
        json.scanner.make_scanner = lambda _: spy  # type: ignore[assignment]
        got = loads_sliced(text, decoder, max_depth=MAX_JSON_DEPTH)
    finally:
        json.scanner.make_scanner = original
    assert got == json.loads(text)
    window = json_slices.WINDOW
    for length, first, _ in calls:
        assert length <= window + 2 or first not in ("[", "{"), (length, first)
    assert len(calls) > 1
    endpoint = Endpoint.COMPLETIONS if kind == "many-prompts" else Endpoint.CHAT
    assert parse_body(raw) == json.loads(text)
    assert validate(raw, endpoint).body == json.loads(text)


def test_members_whose_commas_end_every_window_parse_the_same_with_few_failed_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Small members full of their own commas: a window's last commas fall inside a
    member, so runs fail; after each failure members go one by one for a stretch that
    doubles, so the failed runs stay few (a handful per doubling), not one per member."""
    member = "[" + ",".join(["1"] * 50) + "]"
    text = '{"model": "m", "x": [' + ",".join([member] * 20_000) + "]}"
    runs: list[bool] = []
    original = json_slices._Slicer.run

    def counted(self: Any, i: int, brackets: str) -> tuple[Any, int] | None:
        got = original(self, i, brackets)
        runs.append(got is not None)
        return got

    monkeypatch.setattr(json_slices._Slicer, "run", counted)
    assert loads_sliced(text, _decoder(), max_depth=MAX_JSON_DEPTH) == json.loads(text)
    assert runs.count(False) <= 40 < 20_000
