"""Adversarial input over real HTTP: random JSON shapes, wrong types, huge integers, NaN,
deep nesting, lone surrogates, odd content types and encodings, bad deadline headers,
unknown routes and methods (200 examples, a few seconds; KVGATE_FUZZ_EXAMPLES=N for a
longer hunt). kvgate must answer every one in the contract, never with a
5xx of its own, and nothing invalid may reach the backend (a tap checks each request it
gets, independently of kvgate's validator). The ledger is empty at the end."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import math
import os
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.errors import ERROR_TABLE
from proxy.sim.server import bound_port
from tests.support.stack import MODEL, Stack, running_stack

T = TypeVar("T")
NO_RETRY = {400, 404, 405, 413}
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@dataclass
class Tap:
    """The backend: counts what arrives and records anything a real engine would refuse."""

    cap_tokens: int = 8192  # the output cap kvgate's policy must have enforced
    seen: int = 0
    invalid: list[str] = field(default_factory=list)

    def check(self, path: str, raw: bytes, headers: Any) -> None:
        self.seen += 1

        def bad(why: str) -> None:
            self.invalid.append(f"{path}: {why}: {raw[:200]!r}")

        if headers.get("Content-Type") != "application/json":
            bad(f"content type {headers.get('Content-Type')!r}")
        if "Content-Encoding" in headers or any(k.lower().startswith("x-kvgate-")
                                                for k in headers):
            bad("a header kvgate must not forward")

        def no_constants(name: str) -> Any:
            raise ValueError(name)

        try:
            body = json.loads(raw.decode("utf-8"), parse_constant=no_constants,
                              parse_float=lambda t: no_constants(t) if not math.isfinite(
                                  float(t)) else float(t))
            json.dumps(body, ensure_ascii=False).encode("utf-8")  # no lone surrogates
        except (ValueError, RecursionError) as exc:
            bad(f"not strict UTF-8 JSON ({exc})")
            return
        if not isinstance(body, dict) or body.get("model") != MODEL:
            bad("no object with the served model")
            return
        for key in ("max_tokens", "max_completion_tokens", "n"):
            value = body.get(key)
            limit = 8192 if key == "n" else self.cap_tokens
            if value is not None and (type(value) is not int or not 1 <= value <= limit):
                bad(f"{key}={value!r}")
        if not isinstance(body.get("stream", False), bool):
            bad("stream")
        if path == CHAT:
            messages = body.get("messages")
            if not (isinstance(messages, list) and messages and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
                bad("messages")
        else:
            prompt = body.get("prompt")
            prompts = prompt if isinstance(prompt, list) and prompt and not all(
                type(t) is int for t in prompt) else [prompt]
            if not all(isinstance(p, str | list) and p for p in prompts):
                bad("prompt (an engine refuses an empty one)")


def tap_app(tap: Tap) -> web.Application:
    async def handle(request: web.Request) -> web.Response:
        tap.check(request.path, await request.read(), request.headers)
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        return web.json_response({"id": "x", "object": "chat.completion", "choices": [],
                                  "usage": usage})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_post(CHAT, handle)
    app.router.add_post(COMPLETIONS, handle)
    app.router.add_get("/health", health)
    return app


class LoopThread:
    """The stack's event loop in its own thread; hypothesis drives it synchronously."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@dataclass
class Fuzzed:
    stack: Stack
    tap: Tap
    port: int
    loop: LoopThread
    statuses: dict[int, int] = field(default_factory=dict)


CAP_TOKENS = 20


@pytest.fixture(scope="module", params=["fill", "cap"])
def fuzzed(request: pytest.FixtureRequest) -> Iterator[Fuzzed]:
    """Policy `cap` rewrites (re-serialises) bodies; `fill` forwards them byte for byte."""
    loop = LoopThread()
    cap = request.param == "cap"
    tap = Tap(cap_tokens=CAP_TOKENS if cap else 8192)
    model = {"output_policy": "cap", "output_cap_tokens": CAP_TOKENS} if cap else {}
    runner = web.AppRunner(tap_app(tap), access_log=None)
    loop.run(runner.setup())
    loop.run(web.TCPSite(runner, "127.0.0.1", 0).start())
    cm = running_stack(backends=0, kv_tokens=4096,
                       extra_backend_urls=[f"http://127.0.0.1:{bound_port(runner)}"],
                       server={"body_limit": "256KiB"}, queue={"default_deadline_s": 1.0},
                       model=model)
    stack = loop.run(cm.__aenter__())
    try:
        yield Fuzzed(stack=stack, tap=tap, port=int(stack.url.rsplit(":", 1)[1]), loop=loop)
    finally:
        loop.run(cm.__aexit__(None, None, None))
        loop.run(runner.cleanup())
        loop.close()


# ------------------------------------------------------------------ strategies

scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=10**18)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20))
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
texts = st.text(max_size=40) | st.sampled_from(["", "\ud800", "a\udfffb", "\ud83d\ude00"])
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", ""]) | json_values,
     "content": texts | json_values | st.lists(
         st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                "text": texts | json_values}), max_size=2)})
chat_fields: dict[str, Any] = {
    "model": st.just(MODEL) | json_values,
    "messages": st.lists(message, max_size=3) | json_values,
    "max_tokens": st.integers(min_value=-5, max_value=64) | st.integers() | json_values,
    "max_completion_tokens": st.integers(min_value=1, max_value=64) | json_values,
    "n": st.integers(min_value=1, max_value=3) | st.integers() | json_values,
    "stream": st.booleans() | json_values,
    "tools": st.lists(json_values, max_size=2) | json_values,
    "chat_template_kwargs": st.dictionaries(st.text(max_size=8), json_values) | json_values,
    "add_generation_prompt": st.booleans() | json_values,
}
completion_fields: dict[str, Any] = {
    "model": st.just(MODEL) | json_values,
    "prompt": texts | st.lists(st.integers(min_value=-1, max_value=200_000), max_size=5)
    | st.lists(texts, max_size=3) | json_values,
    "max_tokens": st.integers(min_value=-5, max_value=64) | json_values,
    "n": st.integers(min_value=1, max_value=3) | json_values,
    "stream": st.booleans() | json_values,
}


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=True).encode()  # NaN and lone surrogates kept


@st.composite
def bodies(draw: st.DrawFn, path: str) -> bytes:
    fields = chat_fields if path == CHAT else completion_fields
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 4}
    base.update({"messages": [{"role": "user", "content": "hi"}]} if path == CHAT
                else {"prompt": "hi"})
    keys = draw(st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True))
    for key in keys:
        if draw(st.booleans()) and key not in ("model",):
            base.pop(key, None)
        else:
            base[key] = draw(fields[key])
    raw = _json_bytes(base)
    damage = draw(st.sampled_from(["none", "none", "none", "deep", "truncate", "bytes",
                                   "cesu8", "nan", "top", "hugeint"]))
    if damage == "deep":
        depth = draw(st.sampled_from([65, 1000, 30_000]))
        raw = raw[:-1] + b', "x": ' + b"[" * depth + b"]" * depth + b"}"
    elif damage == "truncate":
        raw = raw[: draw(st.integers(min_value=0, max_value=max(0, len(raw) - 1)))]
    elif damage == "bytes":
        raw = draw(st.binary(max_size=64))
    elif damage == "cesu8":
        raw = raw.replace(b'"hi"', b'"h\xed\xa0\x80i"')
    elif damage == "nan":
        raw = raw[:-1] + draw(st.sampled_from([b', "temperature": NaN}',
                                               b', "temperature": 1e400}',
                                               b', "top_p": -1E+999}']))
    elif damage == "top":
        raw = _json_bytes(draw(json_values))
    elif damage == "hugeint":
        raw = raw[:-1] + b', "seed": 9' + b"9" * 5000 + b"}"
    return raw


header_values = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126),
                        max_size=12)
deadlines = st.sampled_from(["", "nan", "NaN", "-1", "inf", "-inf", "1e400", "0", "500",
                             "abc", " 100 ", "1_000", "0x10", "१२"]) | header_values


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, str, bytes, dict[str, bytes]]:
    kind = draw(st.sampled_from(["chat", "chat", "completions", "completions", "route"]))
    if kind == "route":
        method = draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "POST"]))
        path = draw(st.sampled_from([CHAT, COMPLETIONS, "/v1/models", "/v1/nope", "/",
                                     "/v1/embeddings", "/admin/state", "/metrics"])
                    | st.lists(st.sampled_from(["v1", "chat", "..", "%ff", "%ED%A0%80",
                                                "caf%C3%A9", "", "x?y=%fe"]), max_size=4)
                    .map(lambda parts: "/" + "/".join(parts)))
        if method == "POST" and path in (CHAT, COMPLETIONS):
            method = "GET"
        raw = draw(st.binary(max_size=32))
    else:
        method, path = "POST", CHAT if kind == "chat" else COMPLETIONS
        raw = draw(bodies(path))
    headers: dict[str, bytes] = {}  # bytes: http.client sends them as they are
    content_type = draw(st.sampled_from([
        "application/json", "application/json", "text/plain", "", "multipart/form-data",
        "application/json; charset=utf-16", "application/x-www-form-urlencoded"]))
    if content_type:
        headers["Content-Type"] = content_type.encode()
    if draw(st.booleans()):
        headers["x-kvgate-deadline-ms"] = draw(deadlines).encode()
    if draw(st.integers(min_value=0, max_value=4)) == 0:
        headers["x-kvgate-priority"] = draw(header_values).encode()
        headers["x-kvgate-tenant"] = draw(header_values).encode()
    if draw(st.integers(min_value=0, max_value=3)) == 0:
        # what HTTP allows in a field value (RFC 9110: VCHAR, inner SP, obs-text 0x80-0xFF),
        # not UTF-8 in general: forwarded upstream, hashed for the tenant, parsed as numbers
        name = draw(st.sampled_from(["Authorization", "X-Custom", "x-kvgate-tenant",
                                     "x-kvgate-priority", "x-kvgate-deadline-ms"]))
        vchar = st.sampled_from([*range(0x21, 0x7F), *range(0x80, 0x100)])
        inner = st.lists(vchar | st.just(0x20), max_size=10)
        headers[name] = bytes([draw(vchar), *draw(inner), draw(vchar)])
    if draw(st.integers(min_value=0, max_value=5)) == 0:
        raw = gzip.compress(raw)
        headers["Content-Encoding"] = b"gzip"
    return method, path, raw, headers


def send(port: int, method: str, path: str, raw: bytes,
         headers: dict[str, bytes]) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        # header values as UTF-8 bytes: http.client would refuse non-Latin-1 text itself
        conn.request(method, path, body=raw, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


@settings(max_examples=int(os.environ.get("KVGATE_FUZZ_EXAMPLES", "200")), deadline=None,
          database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=requests())
def test_fuzz_every_answer_follows_the_contract(
    fuzzed: Fuzzed, request: tuple[str, str, bytes, dict[str, bytes]]
) -> None:
    method, path, raw, headers = request
    status, resp_headers, body = send(fuzzed.port, method, path, raw, headers)
    assert status < 500, (status, body[:300])
    fuzzed.statuses[status] = fuzzed.statuses.get(status, 0) + 1
    if status in (200, 204) or (method == "GET" and path in (
            "/v1/models", "/admin/state", "/metrics") and status < 400):
        return
    data = json.loads(body)
    json.dumps(data, ensure_ascii=False).encode("utf-8")  # Unicode text, no lone surrogate
    assert set(data) == {"error"}, data
    error = data["error"]
    assert set(error) == {"message", "type", "code", "param"}, data
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] in ERROR_TABLE, data
    assert ERROR_TABLE[error["code"]].status == status, data
    if status in NO_RETRY:
        assert resp_headers.get("x-should-retry") == "false", (status, resp_headers)
    if status == 429:
        assert int(resp_headers["retry-after"]) >= 1
    if status == 405:
        assert resp_headers.get("allow")


def test_fuzz_reached_the_backend_only_with_valid_requests_and_released_all(
    fuzzed: Fuzzed,
) -> None:
    """Runs after the fuzz (same module, same stack): the tap's findings and the ledger.
    A few valid requests first, so it also proves the tap sees what kvgate admits."""
    before = fuzzed.tap.seen
    for i in range(3):
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user",
                                                               "content": f"valid {i}"}]}
        status, _, answer = send(fuzzed.port, "POST", CHAT, json.dumps(body).encode(),
                                 {"Content-Type": b"application/json"})
        assert status == 200, answer
    assert fuzzed.tap.seen == before + 3

    async def settled() -> dict[str, int]:
        async with asyncio.timeout(5):
            while any(fuzzed.stack.resident().values()):
                await asyncio.sleep(0.01)
        return fuzzed.stack.resident()

    assert fuzzed.loop.run(settled()) == {"sim-0": 0}
    assert fuzzed.stack.state.ledger.lease_count("sim-0") == 0
    assert fuzzed.tap.invalid == [], sorted({i.split(": b")[0] for i in fuzzed.tap.invalid})
