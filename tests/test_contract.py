"""Every input is answered by the error contract over real HTTP: adversarial bodies,
unknown routes and methods, and defects (an unexpected exception is a shaped 500 that
releases its reservation). Also: the cap policy rewrites every cap field, and a client
that leaves mid-stream counts as `client_disconnect`."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

import proxy.server as server_module
from proxy.errors import ERROR_TABLE
from proxy.sim.server import bound_port
from proxy.validation import MAX_JSON_DEPTH
from tests.support.servers import fake_backend
from tests.support.stack import MODEL, Stack, running_stack

ROOT = Path(__file__).resolve().parent.parent
MSGS = [{"role": "user", "content": "What is the capital of France?"}]
PATHS = ("/v1/chat/completions", "/v1/completions")


async def settle(stack: Stack) -> None:
    async with asyncio.timeout(5):
        while any(stack.resident().values()):
            await asyncio.sleep(0.01)


def assert_shaped(data: Any, status: int, code: str) -> dict[str, Any]:
    assert set(data) == {"error"}, data
    assert set(data["error"]) == {"message", "type", "code", "param"}, data
    assert data["error"]["code"] == code, data
    assert isinstance(data["error"]["message"], str) and data["error"]["message"]
    assert ERROR_TABLE[code].status == status
    error: dict[str, Any] = data["error"]
    return error


async def post(s: aiohttp.ClientSession, url: str, raw: bytes,
               **headers: str) -> tuple[int, dict[str, str], Any]:
    async with s.post(url, data=raw,
                      headers={"Content-Type": "application/json", **headers}) as resp:
        return resp.status, dict(resp.headers), await resp.json(content_type=None)


def nested(depth: int, opener: str) -> bytes:
    inner = "[" * depth + "]" * depth if opener == "[" else '{"a":' * depth + "1" + "}" * depth
    return ('{"model": "' + MODEL + '", "messages": ' + inner + "}").encode()


@pytest.mark.parametrize("opener", ["[", "{"])
def test_deeply_nested_body_is_400_invalid_request_on_both_endpoints(opener: str) -> None:
    async def scenario() -> None:
        async with running_stack(backends=1) as stack, aiohttp.ClientSession() as s:
            for path in PATHS:
                for depth in (MAX_JSON_DEPTH + 1, 2_000, 50_000):
                    status, headers, data = await post(s, stack.url + path,
                                                       nested(depth, opener))
                    assert status == 400, (path, depth, data)
                    error = assert_shaped(data, 400, "invalid_request")
                    assert f"deeper than {MAX_JSON_DEPTH} levels" in error["message"]
                    assert error["param"] == "body"
                    assert headers["x-should-retry"] == "false"
            # at the limit the shape check speaks instead: depth is not the problem
            deep: list[Any] = []
            for _ in range(MAX_JSON_DEPTH - 4):
                deep = [deep]  # body 1 + messages 2 + message 3 + these = the limit
            ok_depth = {"model": MODEL, "max_tokens": 3,
                        "messages": [{"role": "user", "content": "x", "extra": deep}]}
            status, _, data = await post(s, stack.url + PATHS[0],
                                         json.dumps(ok_depth).encode())
            assert status == 200, data
            sim = await stack.sim_state(s, 0)
            assert sim["finished"] == 1
            await settle(stack)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        # a lone high surrogate as a JSON escape
        (b'{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
         "messages[0].content"),
        # a lone low surrogate in a key
        (b'{"model": "%s", "messages": [{"role": "user", "content": "x", "n\\udc00": 1}]}',
         "messages[0].<key>"),
        # CESU-8: the surrogate U+D800 encoded as three bytes, not valid UTF-8
        (b'{"model": "%s", "messages": [{"role": "user", "content": "a\xed\xa0\x80"}]}',
         "messages[0].content"),
        # an ill-formed pair (high, high) inside a tool description
        (b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "tools": '
         b'[{"type": "function", "function": {"name": "f", "description": "\\ud83d\\ud83d"}}]}',
         "tools[0].function.description"),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(raw: bytes, param: str) -> None:
    async def scenario() -> None:
        async with running_stack(backends=1) as stack, aiohttp.ClientSession() as s:
            body = raw.replace(b"%s", MODEL.encode())
            status, headers, data = await post(s, stack.url + PATHS[0], body)
            assert status == 400, data
            error = assert_shaped(data, 400, "invalid_request")
            assert error["param"] == param
            assert "lone UTF-16 surrogate" in error["message"]
            assert headers["x-should-retry"] == "false"
            completions = body.replace(b'"messages": [{"role": "user", "content": ',
                                       b'"prompt": ').replace(b"}]", b"")
            if b'"prompt"' in completions and b"tools" not in completions:
                status, _, data = await post(s, stack.url + PATHS[1], completions)
                assert status == 400, (completions, data)
                assert_shaped(data, 400, "invalid_request")
            # a proper pair (an emoji) is text and goes through
            good = (b'{"model": "%s", "max_tokens": 3, "messages": [{"role": "user", '
                    b'"content": "\\ud83d\\ude00"}]}').replace(b"%s", MODEL.encode())
            status, _, data = await post(s, stack.url + PATHS[0], good)
            assert status == 200, data
            sim = await stack.sim_state(s, 0)
            assert sim["finished"] == 1  # only the good one reached the backend
            await settle(stack)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b'{"model": "%s", "messages": [], "max_tokens": NaN}', "NaN"),
        (b'{"model": "%s", "messages": [], "temperature": Infinity}', "Infinity"),
        (b'{"model": "%s", "messages": [], "temperature": 1e400}', "out of the range"),
        (b'{"model": "%s", "max_tokens": 1' + b"0" * 5000 + b"}", "digits"),
        ('{"model": "%s"}'.encode("utf-16"), "UTF-8"),
        (b"\xff\xfe\xfa", "UTF-8"),
    ],
)
def test_non_json_numbers_and_encodings_are_400(raw: bytes, needle: str) -> None:
    async def scenario() -> None:
        async with running_stack(backends=1) as stack, aiohttp.ClientSession() as s:
            for path in PATHS:
                body = raw.replace(b"%s", MODEL.encode())
                status, headers, data = await post(s, stack.url + path, body)
                assert status == 400, data
                error = assert_shaped(data, 400, "invalid_request")
                assert needle in error["message"]
                assert headers["x-should-retry"] == "false"

    asyncio.run(scenario())


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_body_that_is_not_what_its_content_encoding_says_is_400(encoding: str) -> None:
    async def scenario() -> None:
        async with running_stack(backends=1) as stack, aiohttp.ClientSession() as s:
            raw = json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": 5}).encode()
            for path in PATHS:
                status, headers, data = await post(s, stack.url + path, raw,
                                                   **{"Content-Encoding": encoding})
                assert status == 400, data
                error = assert_shaped(data, 400, "invalid_request")
                assert error["param"] == "body"
                assert headers["x-should-retry"] == "false"
            assert stack.resident() == {name: 0 for name in stack.resident()}

    asyncio.run(scenario())


@pytest.mark.parametrize(("extra", "param"), [
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": "5"}, "min_tokens"),
    ({"min_tokens": True}, "min_tokens"), ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_bad_eos_fields_are_400_naming_the_field(extra: dict[str, Any], param: str) -> None:
    async def scenario() -> None:
        async with running_stack(backends=1) as stack, aiohttp.ClientSession() as s:
            raw = json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": 5,
                              **extra}).encode()
            status, _, data = await post(s, stack.url + PATHS[0], raw)
            assert status == 400, data
            assert assert_shaped(data, 400, "invalid_request")["param"] == param

    asyncio.run(scenario())


def test_unknown_route_is_404_not_found_and_wrong_method_405_with_allow() -> None:
    async def scenario() -> None:
        async with running_stack(backends=1) as stack, aiohttp.ClientSession() as s:
            async with s.get(f"{stack.url}/v1/nope") as resp:
                assert resp.status == 404
                assert resp.headers["x-should-retry"] == "false"
                assert resp.headers["Content-Type"].startswith("application/json")
                error = assert_shaped(await resp.json(), 404, "not_found")
                assert "/v1/nope" in error["message"]
            async with s.post(f"{stack.url}/v2/chat/completions", json={}) as resp:
                assert resp.status == 404
                assert_shaped(await resp.json(), 404, "not_found")
            async with s.get(f"{stack.url}/v1/chat/completions") as resp:
                assert resp.status == 405
                assert resp.headers["Allow"] == "POST"
                assert resp.headers["x-should-retry"] == "false"
                error = assert_shaped(await resp.json(), 405, "method_not_allowed")
                assert "GET" in error["message"] and "POST" in error["message"]
            async with s.delete(f"{stack.url}/v1/models") as resp:
                assert resp.status == 405
                assert set(resp.headers["Allow"].split(", ")) == {"GET", "HEAD"}
                assert_shaped(await resp.json(), 405, "method_not_allowed")

    asyncio.run(scenario())


def test_unexpected_exception_is_500_internal_error_and_releases(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    held: list[dict[str, int]] = []

    async def broken_forward(**kwargs: Any) -> web.StreamResponse:
        held.append(stack_ref[0].resident())
        raise RuntimeError("a defect after admission")

    stack_ref: list[Stack] = []
    monkeypatch.setattr(server_module, "forward", broken_forward)

    async def scenario() -> None:
        async with running_stack(backends=1) as stack, aiohttp.ClientSession() as s:
            stack_ref.append(stack)
            body = json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": 50}).encode()
            with caplog.at_level(logging.ERROR, logger="kvgate.request"):
                status, headers, data = await post(s, stack.url + PATHS[0], body)
            assert status == 500
            error = assert_shaped(data, 500, "internal_error")
            assert error["type"] == "server_error"
            request_id = headers["x-kvgate-request-id"]
            assert request_id in error["message"]
            assert "a defect" not in error["message"]  # the cause is logged, not told
            assert headers["x-should-retry"] == "false"
            assert held and held[0]["sim-0"] > 0  # it was holding a reservation ...
            assert stack.resident() == {"sim-0": 0}  # ... and gave it back
            assert stack.state.ledger.lease_count("sim-0") == 0
            logged = [r for r in caplog.records if request_id in r.getMessage()]
            assert logged and logged[0].exc_info is not None
            assert "a defect after admission" in str(logged[0].exc_info[1])
            async with s.get(f"{stack.url}/metrics") as resp:
                text = await resp.text()
            assert re.search(r'kvgate_requests_total\{model="qwen3-14b",'
                             r'outcome="internal_error"\} 1\.0', text)

    asyncio.run(scenario())


def test_unexpected_exception_after_streaming_began_cuts_the_stream_and_releases(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def half_forward(*, request: web.Request, **kwargs: Any) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": []}\n\n')
        raise RuntimeError("a defect mid-stream")

    monkeypatch.setattr(server_module, "forward", half_forward)
    caplog.set_level(logging.CRITICAL, logger="aiohttp")

    async def scenario() -> None:
        async with running_stack(backends=1) as stack, aiohttp.ClientSession() as s:
            body = {"model": MODEL, "messages": MSGS, "max_tokens": 50, "stream": True}
            with caplog.at_level(logging.ERROR, logger="kvgate.request"):
                async with s.post(stack.url + PATHS[0], json=body) as resp:
                    assert resp.status == 200
                    with pytest.raises(aiohttp.ClientPayloadError):
                        await resp.read()  # cut, not a second response glued on
            await settle(stack)
            assert stack.resident() == {"sim-0": 0}
            assert any("unexpected error" in r.getMessage() and r.exc_info
                       for r in caplog.records if r.name == "kvgate.request")

    asyncio.run(scenario())


def test_cap_rewrites_both_max_tokens_fields_when_both_are_given() -> None:
    seen: list[dict[str, Any]] = []

    async def capture(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response({"ok": True})

    async def scenario() -> None:
        async with fake_backend(capture) as url, running_stack(
            backends=0, extra_backend_urls=[url],
            model={"output_policy": "cap", "output_cap_tokens": 20},
        ) as stack, aiohttp.ClientSession() as s:
            for fields in ({"max_tokens": 500, "max_completion_tokens": 500},
                           {"max_completion_tokens": 500}, {"max_tokens": 500}, {}):
                body = {"model": MODEL, "messages": MSGS, **fields}
                async with s.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200
                    assert resp.headers["x-kvgate-output-cap"] == "20"
            assert [{k: v for k, v in b.items() if "tokens" in k} for b in seen] == [
                {"max_tokens": 20, "max_completion_tokens": 20},
                {"max_completion_tokens": 20},
                {"max_tokens": 20},
                {"max_tokens": 20},
            ]
            # Everything else passes unchanged, non-ASCII text and emoji included.
            text = [{"role": "user", "content": "Größe 東京 \U0001F600 \"q\" \\ \n"}]
            body = {"model": MODEL, "messages": text, "max_tokens": 500, "top_p": 0.5}
            async with s.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
            assert seen[-1] == {**body, "max_tokens": 20}
            await settle(stack)

    asyncio.run(scenario())


def test_forwarded_body_is_labelled_json_whatever_the_client_declared() -> None:
    seen: list[tuple[str, str | None]] = []

    async def capture(request: web.Request) -> web.Response:
        seen.append((request.headers["Content-Type"],
                     request.headers.get("Content-Encoding")))
        await request.json()
        return web.json_response({"ok": True})

    async def scenario() -> None:
        async with fake_backend(capture) as url, running_stack(
            backends=0, extra_backend_urls=[url],
        ) as stack, aiohttp.ClientSession() as s:
            raw = json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": 5}).encode()
            for content_type in ("text/plain", "application/x-www-form-urlencoded"):
                async with s.post(f"{stack.url}/v1/chat/completions", data=raw,
                                  headers={"Content-Type": content_type}) as resp:
                    assert resp.status == 200
            assert seen == [("application/json", None)] * 2
            await settle(stack)

    asyncio.run(scenario())


@pytest.fixture
def quiet_aiohttp(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.ERROR)
    return caplog


@pytest.mark.parametrize("content_type", ["text/event-stream", "application/json"])
def test_client_leaving_mid_stream_is_client_disconnect_not_upstream_error(
    quiet_aiohttp: pytest.LogCaptureFixture, content_type: str,
) -> None:
    """Without handler cancellation (aiohttp's default, e.g. under gunicorn's worker), a
    client that leaves shows only as a failed write to it; aiohttp raises that as a
    `ClientError`, the family of upstream failures. It must count as the client's."""
    chunks_sent: list[int] = [0]

    async def slow_stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": content_type})
        await resp.prepare(request)
        for i in range(200):
            await resp.write(b'data: {"i": %d}\n\n' % i)
            chunks_sent[0] += 1
            await asyncio.sleep(0.01)
        await resp.write_eof()
        return resp

    async def scenario() -> None:
        async with fake_backend(slow_stream) as backend, running_stack(
            backends=0, extra_backend_urls=[backend],
        ) as stack:
            runner = web.AppRunner(server_module.build_app(stack.state.config),
                                   handler_cancellation=False, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            state = runner.app[server_module.RUNTIME_KEY]
            url = f"http://127.0.0.1:{bound_port(runner)}"
            try:
                async with aiohttp.ClientSession() as s:
                    body = {"model": MODEL, "messages": MSGS, "max_tokens": 20}
                    resp = await s.post(f"{url}/v1/chat/completions", json=body)
                    await resp.content.readline()
                    assert state.ledger.resident("sim-0") > 0
                    resp.close()
                    async with asyncio.timeout(5):
                        while True:
                            async with s.get(f"{url}/metrics") as m:
                                text = await m.text()
                            if "kvgate_requests_total{" in text:
                                break
                            await asyncio.sleep(0.02)
                assert 'outcome="client_disconnect"} 1.0' in text, text
                assert 'outcome="upstream_error"' not in text
                assert state.ledger.resident("sim-0") == 0
                assert state.backends()[0].inflight == 0
                assert chunks_sent[0] < 200  # the upstream was closed too
                assert not [r for r in quiet_aiohttp.records
                            if r.name.startswith("kvgate") and r.levelno >= logging.ERROR]
            finally:
                await runner.cleanup()

    asyncio.run(scenario())


def test_readme_error_table_lists_every_code() -> None:
    readme = (ROOT / "README.md").read_text()
    table = readme.split("| status | code | when |", 1)[1].split("\n\n", 1)[0]
    for code, cls in ERROR_TABLE.items():
        row = next((line for line in table.splitlines() if f"`{code}`" in line), None)
        assert row is not None, code
        assert row.startswith(f"| {cls.status} |"), row


@pytest.mark.parametrize(("prompt", "param"), [("", "prompt"), (["a", ""], "prompt[1]")])
def test_empty_completion_prompt_is_400_and_never_reaches_the_backend(
    prompt: Any, param: str
) -> None:
    async def scenario() -> None:
        async with running_stack(backends=1) as stack, aiohttp.ClientSession() as s:
            body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4}).encode()
            status, headers, data = await post(s, stack.url + PATHS[1], body)
            assert status == 400, data
            error = assert_shaped(data, 400, "invalid_request")
            assert error["param"] == param and "0 tokens" in error["message"]
            assert headers["x-should-retry"] == "false"
            assert (await stack.sim_state(s, 0))["finished"] == 0
            assert stack.resident() == {"sim-0": 0}

    asyncio.run(scenario())


def test_admin_state_needs_the_admin_token_when_one_is_set() -> None:
    async def scenario() -> None:
        async with running_stack(backends=1, server={"admin_token": "s3cret"}) as stack, \
                aiohttp.ClientSession() as s:
            for auth in (None, "Bearer wrong", "Bearer s3cre", "s3cret!"):
                headers = {"Authorization": auth} if auth else {}
                async with s.get(f"{stack.url}/admin/state", headers=headers) as resp:
                    assert resp.status == 401
                    assert resp.headers["x-should-retry"] == "false"
                    error = assert_shaped(await resp.json(), 401, "unauthorized")
                    assert error["type"] == "authentication_error"
            async with s.get(f"{stack.url}/admin/state",
                             headers={"Authorization": "Bearer s3cret"}) as resp:
                assert resp.status == 200
                assert "sim-0" in (await resp.json())["models"][MODEL]["backends"]

    asyncio.run(scenario())


def _alternating(depth: int) -> str:
    """`[{"k": [{"k": ...}]}]`: arrays and objects alternate, `depth` levels in all."""
    text = "1"
    for level in range(depth):
        text = "[" + text + "]" if level % 2 == 0 else '{"k": ' + text + "}"
    return text


@pytest.mark.parametrize(("depth", "ok"), [(MAX_JSON_DEPTH, True), (MAX_JSON_DEPTH + 1, False)])
def test_parse_body_depth_limit_is_exact_for_mixed_nesting(depth: int, ok: bool) -> None:
    from proxy.errors import InvalidRequest
    from proxy.validation import parse_body

    # brackets inside strings (escaped quotes too) are text, not nesting
    noise = json.dumps({"s": '[{"\\"' * 500, "t": "]" * 500})
    raw = ('{"noise": ' + noise + ', "x": ' + _alternating(depth - 1) + "}").encode()
    if ok:
        assert parse_body(raw)["noise"] == json.loads(noise)
    else:
        with pytest.raises(InvalidRequest, match=f"deeper than {MAX_JSON_DEPTH} levels"):
            parse_body(raw)


def test_header_values_that_are_not_utf8_are_served() -> None:
    """HTTP allows obs-text (0x80-0xFF) in a field value; aiohttp hands such bytes over
    surrogate-escaped. Hashing the Authorization for the tenant must not fail on them."""
    async def scenario() -> None:
        async with running_stack(backends=1) as stack:
            port = int(stack.url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            body = json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": 3}).encode()
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nConnection: close\r\n"
                         b"Authorization: Bearer caf\xe9\xff\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()
            answer = await reader.read()
            writer.close()
            assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
            await settle(stack)

    asyncio.run(scenario())


def test_a_body_of_more_prompts_than_any_backend_holds_is_refused_before_counting() -> None:
    """900,000 one-letter prompts: each holds at least a block, so no backend can ever
    take them all. Answered 413 from the parse alone, counted nowhere, sent nowhere."""
    async def scenario() -> None:
        async with running_stack(backends=1, kv_tokens=65536) as stack, \
                aiohttp.ClientSession() as s:
            body = json.dumps({"model": MODEL, "prompt": ["a"] * 900_000, "max_tokens": 1},
                              separators=(",", ":")).encode()  # 3.6 MB
            status, headers, data = await post(s, stack.url + "/v1/completions", body)
            assert status == 413
            error = assert_shaped(data, 413, "request_too_large")
            assert "900000 prompt(s) x n=1 hold at least 14400000 tokens" in error["message"]
            assert "x-kvgate-prompt-tokens" not in headers  # nothing was counted
            assert (await stack.sim_state(s, 0))["finished"] == 0
            async with s.get(f"{stack.url}/metrics") as resp:
                text = await resp.text()
            assert 'kvgate_rejections_total{model="qwen3-14b",reason="request_too_large"} 1.0' \
                in text
            assert "kvgate_tokenize_seconds_count 0.0" in text

    asyncio.run(scenario())


def test_a_stalled_body_is_answered_408_and_its_connection_closed() -> None:
    async def scenario() -> None:
        async with running_stack(backends=1, server={"body_read_timeout_s": 0.3}) as stack:
            port = int(stack.url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                         b'{"model": "qwen3')  # ... and nothing more
            await writer.drain()
            t0 = asyncio.get_running_loop().time()
            answer = await asyncio.wait_for(reader.read(), 5)  # read() ends: closed
            waited = asyncio.get_running_loop().time() - t0
            writer.close()
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408"), answer[:200]
            assert json.loads(body)["error"]["code"] == "request_timeout"
            assert 0.25 <= waited < 4
            async with aiohttp.ClientSession() as s:
                assert (await stack.sim_state(s, 0))["finished"] == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("on_bound", [False, True])
def test_a_count_that_fails_is_a_500_that_names_the_request_and_holds_nothing(
    monkeypatch: pytest.MonkeyPatch, on_bound: bool
) -> None:
    """Where no tokenizer can count a prompt exactly (`CountFailed`): counted first, it
    is refused with 500 and reaches no backend; admitted on its bound (already sent), it
    keeps the bound, a true upper bound, as its reservation and is served."""
    from proxy.tokenize import CountFailed, TokenCounter

    async def failing(self: TokenCounter, rendered: Any, *args: Any) -> int:
        raise CountFailed("the tokenizer's core gave up on this text")

    async def failing_keys(self: TokenCounter, chat: Any, *args: Any) -> Any:
        raise CountFailed("the tokenizer's core gave up on this text")

    def failing_ids(self: TokenCounter, chat: Any) -> list[int]:
        raise CountFailed("the tokenizer's core gave up on this text")

    monkeypatch.setattr(TokenCounter, "count_rendered_async", failing)
    if not on_bound:  # the shared-prefix count (the simulated engine, in this process,
        # reads ids too: on a bound, after the request is sent, it must still answer)
        monkeypatch.setattr(TokenCounter, "chat_token_ids", failing_ids)
        monkeypatch.setattr(TokenCounter, "count_chat_keys_async", failing_keys)

    async def scenario() -> None:
        server = {"admit_on_bound": on_bound}
        model = {"prefix_sharing": "off"} if on_bound else None  # a bound has no ids
        async with running_stack(backends=1, server=server, model=model) as stack, \
                aiohttp.ClientSession() as s:
            body = json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": 5}).encode()
            status, headers, data = await post(s, stack.url + PATHS[0], body)
            if on_bound:
                assert status == 200, data
                assert int(headers["x-kvgate-reserved-tokens"]) > 0
                assert (await stack.sim_state(s, 0))["finished"] == 1
            else:
                error = assert_shaped(data, 500, "internal_error")
                assert headers["x-kvgate-request-id"] in error["message"]
                assert "could not count" in error["message"]
                assert (await stack.sim_state(s, 0))["finished"] == 0
            await settle(stack)
            async with s.get(f"{stack.url}/metrics") as resp:
                text = await resp.text()
            outcome = "completed" if on_bound else "internal_error"
            assert f'kvgate_requests_total{{model="qwen3-14b",outcome="{outcome}"}} 1.0' in text

    asyncio.run(scenario())


MALFORMED = [
    b"GARBAGE\r\n\r\n",  # no method, path or version
    b"GET /v1/models HTTP/9.9\r\nHost: x\r\n\r\n",  # a version that does not exist
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nBad Header: 1\r\n\r\n",  # space in a name
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nno-colon-here\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",  # request line too long
]


@pytest.mark.parametrize("raw", MALFORMED, ids=["line", "version", "header-name",
                                                 "no-colon", "content-length", "too-long"])
def test_malformed_http_is_a_json_400_with_one_short_log_line(
    raw: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """aiohttp's parser refuses these before any handler runs; kvgate answers them in
    the contract all the same, closes the connection, and logs one line, no traceback."""

    async def scenario() -> tuple[bytes, bytes]:
        async with running_stack(backends=1) as stack:
            port = int(stack.url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(raw)
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), 5)  # read() ends: closed
            writer.close()
            async with aiohttp.ClientSession() as s, s.get(f"{stack.url}/healthz") as resp:
                assert resp.status == 200  # the server goes on
            head, _, body = answer.partition(b"\r\n\r\n")
            return head, body

    with caplog.at_level(logging.DEBUG):
        head, body = asyncio.run(scenario())
    assert re.match(rb"HTTP/1\.[01] 400 ", head), head
    headers = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:])
    assert headers["Content-Type"].startswith("application/json")
    assert headers["x-should-retry"] == "false"
    error = assert_shaped(json.loads(body), 400, "invalid_request")
    assert error["message"].startswith("the request is not valid HTTP/1.1: ")
    assert "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]
    lines = [r for r in caplog.records if "malformed HTTP" in r.getMessage()]
    assert len(lines) == 1 and len(lines[0].getMessage()) < 400
    assert headers["x-kvgate-request-id"] in lines[0].getMessage()
