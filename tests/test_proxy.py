"""The proxy end to end over loopback: the official SDK, rejections, overload, releases."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
from aiohttp import web

from proxy.sim.server import bound_port
from tests.support.metrics import families, samples
from tests.support.reference import hf_count, hf_tokenizer
from tests.support.servers import fake_backend, wait_status
from tests.support.stack import MODEL, MODELS, Stack, running_stack
from tests.support.tasks import stop

MSGS = [{"role": "user", "content": "What is the capital of France?"}]


def client(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="test", max_retries=0)


async def settle(stack: Stack) -> None:
    """Wait until every lease is back and the queue is empty."""
    async with asyncio.timeout(5):
        while any(stack.resident().values()) or any(
            m.controller.queue_depth for m in stack.state.gates.values()
        ):
            await asyncio.sleep(0.01)


def test_sdk_answers_arrive_unchanged_streaming_and_not() -> None:
    async def scenario() -> None:
        async with running_stack() as stack, aiohttp.ClientSession() as s:
            body = {"model": MODEL, "messages": MSGS, "max_tokens": 12}
            async with s.post(f"{stack.sims[0]}/v1/chat/completions", json=body) as resp:
                direct = await resp.json()
            sdk = client(stack)
            raw = await sdk.chat.completions.with_raw_response.create(
                model=MODEL, messages=MSGS, max_tokens=12)  # type: ignore[arg-type]
            answer = raw.parse()
            assert answer.choices[0].message.content == direct["choices"][0]["message"]["content"]
            assert answer.choices[0].finish_reason == "length"
            assert answer.usage is not None and answer.usage.completion_tokens == 12
            # both sides count with kvgate's counter: check them against transformers
            exact = hf_count(hf_tokenizer(MODELS / MODEL), {"messages": MSGS})
            assert answer.usage.prompt_tokens == direct["usage"]["prompt_tokens"] == exact
            assert raw.headers["x-kvgate-prompt-tokens"] == str(exact)
            # prompt + 12 output tokens, rounded up to 16-token blocks
            reserved = -(-(answer.usage.prompt_tokens + 12) // 16) * 16
            assert raw.headers["x-kvgate-reserved-tokens"] == str(reserved)
            assert float(raw.headers["x-kvgate-queue-wait-ms"]) >= 0

            stream = await sdk.chat.completions.create(
                model=MODEL, messages=MSGS, max_tokens=12, stream=True)  # type: ignore[arg-type]
            pieces, reasons = [], []
            async for chunk in stream:
                if chunk.choices:
                    pieces.append(chunk.choices[0].delta.content or "")
                    reasons.append(chunk.choices[0].finish_reason)
            assert "".join(pieces) == direct["choices"][0]["message"]["content"]
            assert reasons[-1] == "length"
            await settle(stack)

    asyncio.run(scenario())


def test_sdk_raises_matching_exceptions_with_our_codes() -> None:
    async def scenario() -> None:
        async with running_stack() as stack:
            sdk = client(stack)
            too_long = [{"role": "user", "content": "word " * 9000}]  # > 8192 tokens alone
            with pytest.raises(openai.BadRequestError) as bad:
                await sdk.chat.completions.create(model=MODEL, messages=too_long,  # type: ignore[arg-type]
                                                  max_tokens=10)
            assert bad.value.code == "context_length_exceeded"
            assert "maximum context length is 8192 tokens" in bad.value.message
            assert bad.value.response.headers["x-should-retry"] == "false"
            with pytest.raises(openai.NotFoundError) as missing:
                await sdk.chat.completions.create(model="nope", messages=MSGS,  # type: ignore[arg-type]
                                                  max_tokens=5)
            assert missing.value.code == "model_not_found"
            assert "qwen3-14b" in missing.value.message

    asyncio.run(scenario())


def test_queue_full_and_timeout_are_429_with_retry_after() -> None:
    async def scenario() -> None:
        async with running_stack(backends=1, kv_tokens=512,
                                 queue={"max_depth": 1, "default_deadline_s": 0.3},
                                 engine={"decode_step_ms": 5}) as stack:
            sdk = client(stack)
            # holds the whole pool: ~14 prompt + 490 output -> 512 reserved
            hog = asyncio.create_task(sdk.chat.completions.create(
                model=MODEL, messages=MSGS, max_tokens=490))  # type: ignore[arg-type]
            await asyncio.sleep(0.1)
            waiter = asyncio.create_task(sdk.chat.completions.create(
                model=MODEL, messages=MSGS, max_tokens=10))  # type: ignore[arg-type]
            await asyncio.sleep(0.05)
            with pytest.raises(openai.RateLimitError) as full:
                await sdk.chat.completions.create(model=MODEL, messages=MSGS,  # type: ignore[arg-type]
                                                  max_tokens=10)
            assert full.value.code == "queue_full"
            assert int(full.value.response.headers["Retry-After"]) >= 1
            assert int(full.value.response.headers["retry-after-ms"]) >= 1
            t0 = time.perf_counter()
            with pytest.raises(openai.RateLimitError) as late:
                await waiter
            assert late.value.code == "queue_timeout"
            assert "waited" in late.value.message
            assert time.perf_counter() - t0 < 0.5
            await hog
            await settle(stack)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_request"),
        (b"[]", 400, "invalid_request"),
        (json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400, "invalid_request"),
        (json.dumps({"model": MODEL, "messages": []}).encode(), 400, "invalid_request"),
        (json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": -5}).encode(), 400,
         "invalid_request"),
        (json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": "ten"}).encode(), 400,
         "invalid_request"),
        # above max_model_len: the (simulated) vLLM refuses it whatever the prompt
        (json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": 10**12}).encode(), 400,
         "invalid_request"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "word " * 9000}],
                     "max_tokens": 1}).encode(), 400, "context_length_exceeded"),
        (json.dumps({"model": MODEL, "messages": MSGS, "stream": "yes"}).encode(), 400,
         "invalid_request"),
        (json.dumps({"model": "gpt-5", "messages": MSGS}).encode(), 404, "model_not_found"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user",
                                                   "content": "x" * 70_000}]}).encode(),
         413, "request_too_large"),
    ],
)
def test_bad_input_gets_contract_4xx_and_never_reaches_backend(
    body: bytes, status: int, code: str
) -> None:
    async def scenario() -> None:
        async with running_stack(backends=1, server={"body_limit": "64KiB"}) as stack, \
                aiohttp.ClientSession() as s:
            async with s.post(f"{stack.url}/v1/chat/completions", data=body,
                              headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == status
                data = await resp.json()
            assert data["error"]["code"] == code
            assert set(data["error"]) == {"message", "type", "code", "param"}
            sim = await stack.sim_state(s, 0)
            assert sim["finished"] == 0 and sim["running"] == 0
            assert stack.resident() == {"sim-0": 0}

    asyncio.run(scenario())


def test_overload_3x_pool_holds_the_ceiling_with_zero_preemptions() -> None:
    deadline_s = 2.0

    async def scenario() -> None:
        async with running_stack(
            backends=2, kv_tokens=2048,
            queue={"max_depth": 24, "default_deadline_s": deadline_s},
            engine={"decode_step_ms": 2.0, "per_seq_ms": 0.02},
        ) as stack, aiohttp.ClientSession() as s:
            capacity = {b.name: b.capacity_tokens for b in stack.state.backends()}
            violations: list[dict[str, int]] = []
            outcomes: list[tuple[int, str | None, float, float | None]] = []

            async def sample() -> None:
                while True:
                    snapshot = stack.resident()
                    if any(snapshot[n] > capacity[n] for n in snapshot):
                        violations.append(snapshot)
                    await asyncio.sleep(0.002)

            async def one(i: int) -> None:
                body = {"model": MODEL, "max_tokens": 150 + (i % 4) * 50,
                        "messages": [{"role": "user", "content": f"request {i} " * 10}]}
                t0 = time.perf_counter()
                async with s.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                    data = await resp.json()
                    elapsed = time.perf_counter() - t0
                    wait = resp.headers.get("x-kvgate-queue-wait-ms")
                    code = None if resp.status == 200 else data["error"]["code"]
                    outcomes.append((resp.status, code, elapsed,
                                     float(wait) / 1000 if wait else None))

            sampler = asyncio.create_task(sample())
            # ~300 resident tokens each; 40 at once is 12,000 tokens: ~3x the 4,096 pool
            async with asyncio.timeout(60):
                await asyncio.gather(*(one(i) for i in range(40)))
            await stop(sampler)
            assert violations == []
            for i in range(2):
                sim = await stack.sim_state(s, i)
                assert sim["preemptions"] == 0
                assert sim["peak_blocks_used"] <= sim["num_blocks"]
            codes = {code for status, code, _, _ in outcomes if status != 200}
            assert codes <= {"queue_full", "queue_timeout"}
            assert sum(1 for status, *_ in outcomes if status == 200) >= 10
            assert codes, "3x overload should reject some requests"
            for _status, _code, _elapsed, wait in outcomes:
                # stated bound: queue wait never exceeds the deadline by more than 100 ms
                assert wait is None or wait <= deadline_s + 0.1
            await settle(stack)
            assert stack.resident() == {"sim-0": 0, "sim-1": 0}

    asyncio.run(scenario())


def test_client_disconnect_mid_stream_releases_once_and_aborts_upstream() -> None:
    async def scenario() -> None:
        async with running_stack(backends=1, engine={"decode_step_ms": 5}) as stack, \
                aiohttp.ClientSession() as s:
            body = {"model": MODEL, "messages": MSGS, "max_tokens": 2000, "stream": True}
            resp = await s.post(f"{stack.url}/v1/chat/completions", json=body)
            await resp.content.readline()
            assert stack.resident()["sim-0"] > 0
            resp.close()
            await settle(stack)
            async with asyncio.timeout(5):
                while (sim := await stack.sim_state(s, 0))["blocks_used"]:
                    await asyncio.sleep(0.02)
            assert sim["generation_tokens_total"] < 2000
            assert stack.state.backends()[0].inflight == 0

    asyncio.run(scenario())


def test_client_disconnect_while_queued_leaves_the_queue() -> None:
    async def scenario() -> None:
        async with running_stack(backends=1, kv_tokens=512,
                                 engine={"decode_step_ms": 5}) as stack, \
                aiohttp.ClientSession() as s:
            sdk = client(stack)
            hog = asyncio.create_task(sdk.chat.completions.create(
                model=MODEL, messages=MSGS, max_tokens=300))  # type: ignore[arg-type]
            await asyncio.sleep(0.1)
            queued = asyncio.create_task(s.post(
                f"{stack.url}/v1/chat/completions",
                json={"model": MODEL, "messages": MSGS, "max_tokens": 300}))
            controller = stack.state.gates[MODEL].controller
            async with asyncio.timeout(2):
                while controller.queue_depth == 0:
                    await asyncio.sleep(0.01)
            queued.cancel()  # the client goes away while waiting
            async with asyncio.timeout(2):
                while controller.queue_depth:
                    await asyncio.sleep(0.01)
            await hog
            await settle(stack)
            assert (await stack.sim_state(s, 0))["finished"] == 1

    asyncio.run(scenario())


def test_upstream_down_before_first_byte_is_502_and_releases() -> None:
    """A backend that answers /health but drops the completion's connection before any
    byte: the lease was made, so the answer is exactly 502 and the ledger is back to 0."""
    calls: list[int] = []

    async def hang_up(request: web.Request) -> web.StreamResponse:
        await request.read()
        calls.append(1)
        assert request.transport is not None
        request.transport.close()  # no status line, no byte
        return web.Response()

    async def scenario() -> None:
        # sharing off: its engine poll would pool connections of its own (GET /metrics)
        async with fake_backend(hang_up) as url, \
                running_stack(backends=0, extra_backend_urls=[url],
                              model={"prefix_sharing": "off"}) as stack, \
                aiohttp.ClientSession() as s:
            await wait_status(s, f"{stack.url}/readyz", 200, timeout_s=3)
            async with s.post(f"{stack.url}/v1/chat/completions",
                              json={"model": MODEL, "messages": MSGS, "max_tokens": 5}) as resp:
                data = await resp.json()
                assert (resp.status, data["error"]["code"]) == (502, "upstream_error"), data
            # it reached the backend: a reservation was held. Twice where the first send
            # went out on the health probe's pooled connection: a request lost on a
            # reused connection goes again on another (tests/test_forward_retry.py)
            assert calls in ([1], [1, 1])
            assert stack.resident() == {"sim-0": 0}
            assert stack.state.ledger.lease_count("sim-0") == 0
            assert stack.state.backends()[0].inflight == 0

    asyncio.run(scenario())


def test_backend_that_refuses_connections_is_marked_down_and_503() -> None:
    async def scenario() -> None:
        # a port with nothing listening: connection refused, for the probe too
        probe = web.AppRunner(web.Application())
        await probe.setup()
        site = web.TCPSite(probe, "127.0.0.1", 0)
        await site.start()
        dead = f"http://127.0.0.1:{bound_port(probe)}"
        await probe.cleanup()
        async with running_stack(backends=0, extra_backend_urls=[dead]) as stack, \
                aiohttp.ClientSession() as s:
            await wait_status(s, f"{stack.url}/readyz", 503, timeout_s=3)
            async with s.post(f"{stack.url}/v1/chat/completions",
                              json={"model": MODEL, "messages": MSGS, "max_tokens": 5}) as resp:
                assert resp.status == 503
                assert (await resp.json())["error"]["code"] == "no_backend"
                assert "Retry-After" in resp.headers
            assert stack.resident() == {"sim-0": 0}

    asyncio.run(scenario())


def test_a_failure_inside_an_event_ends_with_an_error_event_the_sdk_can_read() -> None:
    """The backend dies halfway through an event, its first half already sent: the
    client gets the whole events before it and then kvgate's `error` event, never the
    half event glued to it (which the official SDK fails to parse as JSON)."""
    async def broken(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"id":"1","object":"chat.completion.chunk","created":0,'
                         b'"model":"m","choices":[{"index":0,"delta":{"content":"hi"},'
                         b'"finish_reason":null}]}\n\ndata: {"id":"1","obj')
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.close()
        return resp

    async def scenario() -> None:
        async with fake_backend(broken) as url, \
                running_stack(backends=0, extra_backend_urls=[url]) as stack, \
                aiohttp.ClientSession() as s:
            body = {"model": MODEL, "messages": MSGS, "max_tokens": 5, "stream": True}
            async with s.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                text = (await resp.read()).decode()
            events = [e for e in text.split("\n\n") if e]
            assert events[0].startswith('data: {"id":"1"') and '"content":"hi"' in events[0]
            assert events[1].startswith("event: error\ndata: ") and len(events) == 2
            assert json.loads(events[1].split("data: ", 1)[1])["error"]["code"] == \
                "upstream_error"
            sdk = client(stack)
            stream = await sdk.chat.completions.create(
                model=MODEL, messages=MSGS, max_tokens=5, stream=True)  # type: ignore[arg-type]
            with pytest.raises(openai.APIError) as failed:
                async for _ in stream:
                    pass
            assert not isinstance(failed.value, json.JSONDecodeError)
            await settle(stack)

    asyncio.run(scenario())


def test_upstream_failure_mid_stream_ends_with_sse_error_event() -> None:
    async def broken(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n')
        assert request.transport is not None
        request.transport.close()
        return resp

    async def scenario() -> None:
        async with fake_backend(broken) as url, \
                running_stack(backends=0, extra_backend_urls=[url]) as stack, \
                aiohttp.ClientSession() as s:
            body = {"model": MODEL, "messages": MSGS, "max_tokens": 5, "stream": True}
            async with s.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                text = (await resp.read()).decode()
            assert resp.status == 200
            assert '"content":"hi"' in text
            assert "event: error" in text and '"code": "upstream_error"' in text
            assert "[DONE]" not in text
            await settle(stack)

    asyncio.run(scenario())


def test_cap_policy_sets_max_tokens_and_says_so() -> None:
    async def scenario() -> None:
        async with running_stack(backends=1, model={"output_policy": "cap",
                                                    "output_cap_tokens": 20}) as stack:
            raw = await client(stack).chat.completions.with_raw_response.create(
                model=MODEL, messages=MSGS)  # type: ignore[arg-type]
            answer = raw.parse()
            assert raw.headers["x-kvgate-output-cap"] == "20"
            assert answer.choices[0].finish_reason == "length"
            assert answer.usage is not None and answer.usage.completion_tokens == 20
            raw = await client(stack).chat.completions.with_raw_response.create(
                model=MODEL, messages=MSGS, max_tokens=7)  # type: ignore[arg-type]
            assert "x-kvgate-output-cap" not in raw.headers
            assert raw.parse().usage.completion_tokens == 7  # type: ignore[union-attr]

    asyncio.run(scenario())


def test_require_policy_rejects_missing_max_tokens() -> None:
    async def scenario() -> None:
        async with running_stack(backends=1, model={"output_policy": "require"}) as stack:
            with pytest.raises(openai.BadRequestError) as info:
                await client(stack).chat.completions.create(model=MODEL, messages=MSGS)  # type: ignore[arg-type]
            assert info.value.code == "max_tokens_required"

    asyncio.run(scenario())


def test_demand_beyond_any_backend_is_413_and_deadline_header_shortens() -> None:
    async def scenario() -> None:
        async with running_stack(backends=1, kv_tokens=1024,
                                 engine={"decode_step_ms": 5}) as stack, \
                aiohttp.ClientSession() as s:
            async with s.post(f"{stack.url}/v1/chat/completions",
                              json={"model": MODEL, "messages": MSGS, "max_tokens": 2000}) as r:
                assert r.status == 413
                assert (await r.json())["error"]["code"] == "request_too_large"
                assert r.headers["x-should-retry"] == "false"
            hog = asyncio.create_task(s.post(
                f"{stack.url}/v1/chat/completions",
                json={"model": MODEL, "messages": MSGS, "max_tokens": 1000}))
            await asyncio.sleep(0.1)
            t0 = time.perf_counter()
            async with s.post(f"{stack.url}/v1/chat/completions",
                              json={"model": MODEL, "messages": MSGS, "max_tokens": 100},
                              headers={"x-kvgate-deadline-ms": "150"}) as r:
                assert r.status == 429
                assert (await r.json())["error"]["code"] == "queue_timeout"
            assert 0.15 <= time.perf_counter() - t0 < 0.6
            (await hog).close()
            await settle(stack)

    asyncio.run(scenario())


def test_completions_n_and_token_prompts_reserve_each_choice() -> None:
    async def scenario() -> None:
        async with running_stack(backends=1) as stack, aiohttp.ClientSession() as s:
            body = {"model": MODEL, "prompt": [1, 2, 3, 4, 5], "max_tokens": 11, "n": 2}
            async with s.post(f"{stack.url}/v1/completions", json=body) as r:
                data = await r.json()
                # 2 choices x cdiv(5 + 11, 16) blocks x 16
                assert r.headers["x-kvgate-reserved-tokens"] == "32"
                assert r.headers["x-kvgate-prompt-tokens"] == "5"
            assert data["usage"]["completion_tokens"] == 22
            await settle(stack)

    asyncio.run(scenario())


def test_metrics_admin_state_models_and_health_endpoints() -> None:
    async def scenario() -> None:
        async with running_stack(backends=2) as stack, aiohttp.ClientSession() as s:
            await client(stack).chat.completions.create(model=MODEL, messages=MSGS,  # type: ignore[arg-type]
                                                        max_tokens=4)
            async with s.get(f"{stack.url}/metrics") as r:
                text = await r.text()
            got = samples(text)
            # one completed request, nothing rejected, nothing held or waiting now
            assert got["kvgate_requests_total"] == [
                ({"model": MODEL, "outcome": "completed"}, 1.0)]
            assert "kvgate_rejections" in families(text)
            assert sum(v for _, v in got.get("kvgate_rejections_total", [])) == 0
            for name in ("kvgate_queue_wait_seconds", "kvgate_prompt_tokens",
                         "kvgate_reserved_tokens", "kvgate_tokenize_seconds",
                         "kvgate_upstream_first_byte_seconds"):
                assert [v for _, v in got[f"{name}_count"]] == [1.0], name
                assert got[f"{name}_bucket"], name
            assert {lab["backend"]: v for lab, v in got["kvgate_capacity_tokens"]} == {
                "sim-0": 4096.0, "sim-1": 4096.0}
            assert {v for _, v in got["kvgate_resident_tokens"]} == {0.0}
            assert {v for _, v in got["kvgate_inflight_requests"]} == {0.0}
            assert max(v for _, v in got["kvgate_inflight_requests_peak"]) == 1.0
            assert [v for _, v in got["kvgate_queue_depth"]] == [0.0]
            assert got["kvgate_headroom_tokens_min"]
            assert got["kvgate_ledger_available"] == [({}, 1.0)]
            async with s.get(f"{stack.url}/admin/state") as r:
                st = await r.json()
            backends = st["models"][MODEL]["backends"]
            assert {b["capacity_tokens"] for b in backends.values()} == {4096}
            assert all(b["resident_tokens"] == 0 for b in backends.values())
            async with s.get(f"{stack.url}/v1/models") as r:
                assert (await r.json())["data"][0]["id"] == MODEL
            for path in ("/healthz", "/readyz"):
                async with s.get(f"{stack.url}{path}") as r:
                    assert r.status == 200

    asyncio.run(scenario())


def test_body_goes_upstream_byte_identical_with_backend_key_and_no_hop_headers() -> None:
    seen: list[tuple[bytes, dict[str, str]]] = []

    async def capture(request: web.Request) -> web.Response:
        seen.append((await request.read(), dict(request.headers)))
        return web.json_response({"ok": True}, headers={"Connection": "keep-alive",
                                                        "x-backend": "yes"})

    async def scenario() -> None:
        async with fake_backend(capture) as url, \
                running_stack(backends=0, extra_backend_urls=[url]) as stack, \
                aiohttp.ClientSession() as s:
            stack.state.gates[MODEL].controller.backends[0].api_key = "backend-secret"
            # odd spacing and key order must survive: the bytes are not re-serialised
            raw = (b'{ "max_tokens" : 5,"model":"qwen3-14b",  "messages": '
                   b'[{"role":"user","content":"caf\\u00e9"}], "temperature": 0.70}')
            async with s.post(f"{stack.url}/v1/chat/completions", data=raw, headers={
                "Content-Type": "application/json", "Authorization": "Bearer client-key",
                "x-kvgate-deadline-ms": "1000", "X-Custom": "kept",
            }) as resp:
                assert resp.status == 200
                assert resp.headers["x-backend"] == "yes"
                assert "x-kvgate-prompt-tokens" in resp.headers
            body, headers = seen[0]
            assert body == raw
            assert headers["Authorization"] == "Bearer backend-secret"
            assert headers["X-Custom"] == "kept"
            assert not any(k.lower().startswith("x-kvgate-") for k in headers)
            await settle(stack)

    asyncio.run(scenario())


def test_capacity_read_from_backend_metrics() -> None:
    async def scenario() -> None:
        deployment = {"capacity_from_backend": True, "block_size": 16}
        async with running_stack(backends=1, kv_tokens=3000,
                                 model={"deployment": deployment}) as stack, \
                aiohttp.ClientSession() as s:
            backend = stack.state.backends()[0]
            async with asyncio.timeout(5):
                while backend.capacity_tokens == 0:
                    await asyncio.sleep(0.05)
            assert backend.capacity_tokens == 2992  # 187 blocks x 16, as the sim reports
            async with s.get(f"{stack.url}/readyz") as r:
                assert r.status == 200
            async with s.post(f"{stack.url}/v1/chat/completions",
                              json={"model": MODEL, "messages": MSGS, "max_tokens": 2990}) as r:
                assert r.status == 413
            async with s.post(f"{stack.url}/v1/chat/completions",
                              json={"model": MODEL, "messages": MSGS, "max_tokens": 20}) as r:
                assert r.status == 200
            await settle(stack)

    asyncio.run(scenario())


def test_priority_class_from_api_key_goes_first() -> None:
    async def scenario() -> None:
        queue = {"ordering": "priority", "priority_by_api_key": {"vip-key": "high",
                                                                 "batch-key": "low"}}
        async with running_stack(backends=1, kv_tokens=512, queue=queue,
                                 engine={"decode_step_ms": 3}) as stack, \
                aiohttp.ClientSession() as s:
            finished: list[str] = []

            async def call(key: str, max_tokens: int) -> None:
                async with s.post(f"{stack.url}/v1/chat/completions",
                                  json={"model": MODEL, "messages": MSGS,
                                        "max_tokens": max_tokens},
                                  headers={"Authorization": f"Bearer {key}",
                                           "x-kvgate-priority": "high"}) as resp:
                    assert resp.status == 200
                    await resp.read()
                finished.append(key)

            hog = asyncio.create_task(call("hog-key", 300))
            await asyncio.sleep(0.1)
            # both need most of the pool; the batch key arrives first and claims "high"
            batch = asyncio.create_task(call("batch-key", 300))
            await asyncio.sleep(0.05)
            vip = asyncio.create_task(call("vip-key", 300))
            await asyncio.sleep(0.05)
            assert stack.state.gates[MODEL].controller.queue_depth == 2
            async with asyncio.timeout(10):
                await asyncio.gather(hog, batch, vip)
            assert finished == ["hog-key", "vip-key", "batch-key"]
            await settle(stack)

    asyncio.run(scenario())


def test_large_body_arriving_in_pieces_is_read_whole() -> None:
    async def scenario() -> None:
        # a context long enough to count it whole, a backend too small to hold it
        async with running_stack(backends=1, kv_tokens=32_768,
                                 model={"max_model_len": 131_072}) as stack, \
                aiohttp.ClientSession() as s:
            content = "word " * 60_000  # ~300 KB of JSON, 60,000 tokens plus the template
            payload = json.dumps({"model": MODEL, "max_tokens": 4, "messages": [
                {"role": "user", "content": content}]}).encode()

            async def pieces() -> AsyncIterator[bytes]:
                for i in range(0, len(payload), 8192):
                    yield payload[i:i + 8192]
                    await asyncio.sleep(0)

            async with s.post(f"{stack.url}/v1/chat/completions", data=pieces(),
                              headers={"Content-Type": "application/json"}) as resp:
                data = await resp.json()
            # the whole body was parsed: the count covers all 60,000 words
            assert data["error"]["code"] == "request_too_large", data
            assert int(resp.headers["x-kvgate-prompt-tokens"]) > 60_000

    asyncio.run(scenario())


@pytest.mark.parametrize(("kind", "expected"), [("vllm", "16"), ("sglang", "16"),
                                                 ("tgi", "rest"), ("llama.cpp", "rest")])
def test_completions_without_max_tokens_reserve_the_engines_default(
    kind: str, expected: str
) -> None:
    """vLLM and SGLang generate 16 tokens for a completion without `max_tokens`; TGI and
    llama.cpp generate until the context ends, so kvgate reserves the whole rest."""
    async def scenario() -> None:
        async with running_stack(backends=1, kv_tokens=8192, backend={"kind": kind}) as stack, \
                aiohttp.ClientSession() as s:
            body = {"model": MODEL, "prompt": "The capital of France is"}
            async with s.post(f"{stack.url}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                prompt = int(resp.headers["x-kvgate-prompt-tokens"])
                reserved = int(resp.headers["x-kvgate-reserved-tokens"])
            assert reserved == (-(-(prompt + 16) // 16) * 16 if expected == "16" else 8192)
            await settle(stack)

    asyncio.run(scenario())


def test_a_cap_forwarded_for_several_prompts_is_reserved_and_checked_for_each() -> None:
    """One body carries one max_tokens for all its prompts. With `cap` in front of an
    engine that runs to the context's end, a short prompt is capped and a long one is
    not: the cap is forwarded for both, so each reserves it up to its context's end
    (where the engine stops), and a prompt that fills the context alone is a 400
    whatever its place in the list."""
    long_prompt = "word " * 7400  # with the cap of 1000: past the context's end
    too_long = "word " * 8300  # fills the context alone

    async def scenario() -> None:
        model = {"output_policy": "cap", "output_cap_tokens": 1000}
        async with running_stack(backends=1, kv_tokens=32768, model=model,
                                 backend={"kind": "llama.cpp"}) as stack, \
                aiohttp.ClientSession() as s:
            url = f"{stack.url}/v1/completions"
            for prompts in (["Hi", too_long], [too_long, "Hi"]):
                async with s.post(url, json={"model": MODEL, "prompt": prompts}) as resp:
                    data = await resp.json()
                    assert resp.status == 400, data
                    assert data["error"]["code"] == "context_length_exceeded"
            counts = []
            for prompt in ("Hi", long_prompt):
                async with s.post(url, json={"model": MODEL, "prompt": prompt,
                                             "max_tokens": 1}) as resp:
                    assert resp.status == 200, await resp.text()
                    counts.append(int(resp.headers["x-kvgate-prompt-tokens"]))
            assert counts[1] + 1000 > 8192  # the cap runs past the context's end
            async with s.post(url, json={"model": MODEL, "prompt": ["Hi", long_prompt]}) \
                    as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["x-kvgate-output-cap"] == "1000"
                reserved = int(resp.headers["x-kvgate-reserved-tokens"])
            assert reserved == -(-(counts[0] + 1000) // 16) * 16 + 8192
            await settle(stack)

    asyncio.run(scenario())


@pytest.mark.parametrize("trust", [False, True])
def test_tenant_is_the_api_key_unless_the_header_is_trusted(trust: bool) -> None:
    """A client-set tenant header names the tenant only with `queue.trust_tenant_header`;
    otherwise one API key is one tenant, whatever names it sends. Every admission,
    queued or not, is charged."""
    from policies.ordering import PriorityFairShare

    async def scenario() -> None:
        queue = {"ordering": "priority", "trust_tenant_header": trust}
        async with running_stack(backends=1, queue=queue) as stack, \
                aiohttp.ClientSession() as s:
            for name in ("alpha", "beta", "gamma"):
                body = {"model": MODEL, "messages": MSGS, "max_tokens": 4}
                headers = {"Authorization": "Bearer key-1", "x-kvgate-tenant": name}
                async with s.post(f"{stack.url}/v1/chat/completions", json=body,
                                  headers=headers) as resp:
                    assert resp.status == 200, await resp.text()
            await settle(stack)
            policy = stack.state.gates[MODEL].controller._ordering
            assert isinstance(policy, PriorityFairShare)
            tenants = sorted(policy._usage)
            assert tenants == (["alpha", "beta", "gamma"] if trust else tenants[:1])
            assert len(tenants) == (3 if trust else 1)

    asyncio.run(scenario())
