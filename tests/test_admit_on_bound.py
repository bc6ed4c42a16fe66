"""Admission on an upper bound of the prompt, the exact count after (`admit_on_bound`).

While nothing waits and a backend has room for the bound (UTF-8 bytes of the rendered
chat, for byte-level BPE), kvgate forwards at once and counts while the backend
starts; the headers, the lease, the tracker and the context check still end on the
exact count. These tests run over real HTTP against the simulator and check the
counts against transformers; the bound itself is checked against the encoders on the
corpus and on fuzzed text.

A bound has no token ids, so a model that shares prefix blocks counts first where
the keys decide placement or the charge (`proxy.gate`): these stacks turn sharing off,
where bound admission always applies (with sharing: `tests/test_prefix_sharing.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.placement import PlacementName
from proxy.admission import Backend, Demand
from proxy.config import QueueConfig
from proxy.gate import controller_for
from proxy.ledger import MemoryLedger
from proxy.tokenize import ChatRequest, TokenCounter, load_counter
from proxy.tokenize.bytelevel import ENV_SWITCH
from tests.support.corpus import WORDS, conversations
from tests.support.metrics import samples
from tests.support.reference import hf_count, hf_tokenizer
from tests.support.servers import fake_backend
from tests.support.stack import MODEL, MODELS, Stack, running_stack

ASCII_WORDS = [w for w in WORDS if w.isascii()]

BOUND: dict[str, Any] = {"prefix_sharing": "off"}


def ascii_chat(n_words: int, seed: int = 7) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [{"role": "user", "content": " ".join(rng.choice(ASCII_WORDS) for _ in range(n_words))}]


async def metric(session: aiohttp.ClientSession, stack: Stack, name: str) -> float:
    async with session.get(f"{stack.url}/metrics") as resp:
        got = samples(await resp.text())
    return sum(v for _, v in got.get(name, []))


async def settle(stack: Stack) -> None:
    async with asyncio.timeout(5):
        while any(stack.resident().values()):
            await asyncio.sleep(0.01)


def bound_of(stack: Stack, messages: list[dict[str, Any]]) -> int:
    rendered = stack.state.gates[MODEL].counter.render_for_count(ChatRequest(messages=messages))
    assert rendered is not None and rendered.max_tokens is not None
    return rendered.max_tokens


@contextlib.asynccontextmanager
async def behind(chat_handler: Any) -> AsyncIterator[Stack]:
    """kvgate in front of one hand-written backend, once it is seen healthy."""
    async with fake_backend(chat_handler) as url, \
            running_stack(backends=0, extra_backend_urls=[url], model=BOUND) as stack:
        async with asyncio.timeout(5):
            while not stack.state.backends()[0].healthy:
                await asyncio.sleep(0.02)
        yield stack


def blocks(tokens: int) -> int:
    return -(-tokens // 16) * 16


@pytest.mark.parametrize("reservation", ["strict", "adaptive"])
def test_a_request_admitted_on_its_bound_ends_on_its_exact_count(reservation: str) -> None:
    messages = ascii_chat(300)
    exact = hf_count(hf_tokenizer(MODELS / MODEL), {"messages": messages})

    async def scenario() -> None:
        async with running_stack(backends=1, kv_tokens=16384,
                                 model={**BOUND, "reservation": reservation},
                                 engine={"decode_step_ms": 50}) as stack, \
                aiohttp.ClientSession() as s:
            model = stack.state.gates[MODEL]
            bound = bound_of(stack, messages)
            assert bound > exact  # ~5 bytes a token: the lease must shrink
            # the most the exact demand may hold: an adaptive lease grows from `want`
            # as the stream runs (the 40 tokens take 2 s), so the check must not wait
            # for it to be back at `want`, which it is only once released (at 0)
            most = max(blocks(exact + 40), blocks(exact + 1))
            assert bound > most
            body = {"model": MODEL, "messages": messages, "max_tokens": 40, "stream": True}
            async with s.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                assert resp.headers["x-kvgate-prompt-tokens"] == str(exact)
                if model.tracker is None:
                    want = blocks(exact + 40)
                else:
                    want = model.tracker.lease_tokens(prompt_tokens=exact, max_tokens=40, n=1,
                                                      min_tokens=0, strict=False)
                    live = list(model.tracker._live.values())
                    assert [p.prompt_tokens for p in live] == [exact]
                assert resp.headers["x-kvgate-reserved-tokens"] == str(want)
                # admitted on the bound, then shrunk to the exact demand while streaming
                assert await metric(s, stack, "kvgate_bound_admissions_total") == 1.0
                async with asyncio.timeout(2):
                    while stack.resident()["sim-0"] > most:
                        await asyncio.sleep(0.005)
                assert want <= stack.resident()["sim-0"] <= most  # shrunk, still held
                events = [line async for line in resp.content if line.startswith(b"data:")]
            assert events[-1].strip() == b"data: [DONE]"
            await settle(stack)
            assert stack.state.ledger.lease_count("sim-0") == 0
            async with s.get(f"{stack.url}/metrics") as resp:
                got = samples(await resp.text())
            # the exact figures, once each, in the histograms
            assert [v for _, v in got["kvgate_prompt_tokens_sum"]] == [float(exact)]
            assert [v for _, v in got["kvgate_reserved_tokens_sum"]] == [float(want)]

    asyncio.run(scenario())


def test_a_lease_on_a_bound_shrinks_once_counted_not_when_the_answer_begins() -> None:
    """A JSON answer begins only when the engine has generated all of it: the lease
    must not hold its bound (~5 bytes a token here) until then, while requests that fit
    on the exact figure wait for it. It shrinks once the count is in, and the reply's
    headers still report the exact figures."""
    messages = ascii_chat(300)
    exact = hf_count(hf_tokenizer(MODELS / MODEL), {"messages": messages})
    reached = asyncio.Event()
    answer = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        await request.read()
        reached.set()
        await answer.wait()  # generating: no byte of the answer yet
        return web.json_response({"choices": [], "usage": {"completion_tokens": 1}})

    async def scenario() -> None:
        async with behind(slow) as stack, aiohttp.ClientSession() as s:
            bound = bound_of(stack, messages)
            want = blocks(exact + 40)
            assert blocks(bound + 40) > want
            body = {"model": MODEL, "messages": messages, "max_tokens": 40}
            reply = asyncio.ensure_future(s.post(f"{stack.url}/v1/chat/completions",
                                                 json=body))
            async with asyncio.timeout(5):
                await reached.wait()
                while stack.resident()["sim-0"] != want:
                    await asyncio.sleep(0.005)
            assert not reply.done()
            answer.set()
            async with await reply as resp:
                assert resp.status == 200
                assert resp.headers["x-kvgate-prompt-tokens"] == str(exact)
                assert resp.headers["x-kvgate-reserved-tokens"] == str(want)
            assert await metric(s, stack, "kvgate_bound_admissions_total") == 1.0
            await settle(stack)
            assert stack.state.ledger.lease_count("sim-0") == 0

    asyncio.run(scenario())


def test_without_room_for_the_bound_the_exact_count_admits() -> None:
    """Room for the exact demand but not for the bound: counted first, admitted, 200."""
    messages = ascii_chat(300)
    exact = hf_count(hf_tokenizer(MODELS / MODEL), {"messages": messages})

    async def scenario() -> None:
        async with running_stack(backends=1, kv_tokens=1024, model=BOUND) as stack, \
                aiohttp.ClientSession() as s:
            assert bound_of(stack, messages) + 100 > 1024 >= blocks(exact + 100)
            body = {"model": MODEL, "messages": messages, "max_tokens": 100}
            async with s.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                assert resp.headers["x-kvgate-prompt-tokens"] == str(exact)
                assert resp.headers["x-kvgate-reserved-tokens"] == str(blocks(exact + 100))
                await resp.read()
            assert await metric(s, stack, "kvgate_bound_admissions_total") == 0.0
            await settle(stack)

    asyncio.run(scenario())


def test_the_context_check_is_made_on_the_exact_count() -> None:
    """bound + max_tokens over the context but exact + max_tokens within: admitted and
    reserved on the exact count; exact + max_tokens over: still served (the engine stops
    at the context's end), reserved up to that end; a prompt that fills the context
    alone is a 400 that names the exact count."""
    messages = ascii_chat(1200)
    exact = hf_count(hf_tokenizer(MODELS / MODEL), {"messages": messages})

    async def scenario() -> None:
        async with running_stack(backends=1, kv_tokens=16384, model=BOUND) as stack, \
                aiohttp.ClientSession() as s:
            fits = 8192 - exact
            assert bound_of(stack, messages) + fits > 8192
            body = {"model": MODEL, "messages": messages, "max_tokens": fits}
            async with s.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["x-kvgate-prompt-tokens"] == str(exact)
                assert resp.headers["x-kvgate-reserved-tokens"] == "8192"
            body["max_tokens"] = fits + 1000
            async with s.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["x-kvgate-prompt-tokens"] == str(exact)
                assert resp.headers["x-kvgate-reserved-tokens"] == "8192"
            long = [{"role": "user", "content": "word " * 8300}]
            exact_long = hf_count(hf_tokenizer(MODELS / MODEL), {"messages": long})
            assert exact_long >= 8192
            body = {"model": MODEL, "messages": long, "max_tokens": 5}
            async with s.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 400
                error = (await resp.json())["error"]
                assert error["code"] == "context_length_exceeded"
                assert f"({exact_long} in the messages, 5 in the completion)" \
                    in error["message"]
            await settle(stack)

    asyncio.run(scenario())


def test_an_upstream_failure_before_the_reply_releases_a_bound_lease() -> None:
    async def drop(request: web.Request) -> web.StreamResponse:
        await request.read()
        assert request.transport is not None
        request.transport.close()  # the backend dies before answering
        return web.Response()

    async def scenario() -> None:
        async with behind(drop) as stack, aiohttp.ClientSession() as s:
            body = {"model": MODEL, "messages": ascii_chat(50), "max_tokens": 10}
            async with s.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 502
                assert (await resp.json())["error"]["code"] == "upstream_error"
            assert await metric(s, stack, "kvgate_bound_admissions_total") == 1.0
            assert stack.resident() == {"sim-0": 0}
            assert stack.state.ledger.lease_count("sim-0") == 0

    asyncio.run(scenario())


def test_with_requests_in_flight_the_count_comes_first() -> None:
    """The bound only hides the count in idle loop time: from the fourth request in
    flight on, requests are counted before admission."""
    messages = ascii_chat(50)

    async def scenario() -> None:
        async with running_stack(backends=1, kv_tokens=16384, model=BOUND,
                                 engine={"decode_step_ms": 20}) as stack, \
                aiohttp.ClientSession() as s:
            body = {"model": MODEL, "messages": messages, "max_tokens": 30, "stream": True}
            held = []
            for _ in range(4):
                resp = await s.post(f"{stack.url}/v1/chat/completions", json=body)
                assert resp.status == 200
                held.append(resp)
            assert stack.state.gates[MODEL].controller.inflight == 4
            body["stream"] = False
            async with s.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
            assert await metric(s, stack, "kvgate_bound_admissions_total") == 4.0
            for resp in held:
                await resp.read()
                resp.release()
            await settle(stack)

    asyncio.run(scenario())


def test_turned_off_every_request_is_counted_first() -> None:
    messages = ascii_chat(100)

    async def scenario() -> None:
        async with running_stack(backends=1, server={"admit_on_bound": False}) as stack, \
                aiohttp.ClientSession() as s:
            body = {"model": MODEL, "messages": messages, "max_tokens": 10}
            async with s.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
            assert await metric(s, stack, "kvgate_bound_admissions_total") == 0.0

    asyncio.run(scenario())


def test_try_acquire_never_jumps_the_queue() -> None:
    async def scenario() -> None:
        backend = Backend(name="b", url="http://127.0.0.1:1", capacity_tokens=100)
        controller = controller_for(model="m", backends=[backend], ledger=MemoryLedger(),
                                    queue=QueueConfig(), placement=PlacementName.BEST_FIT,
                                    on_event=lambda kind, lease: None)

        def demand(tokens: int) -> Demand:
            return Demand(tokens=tokens, prompt_tokens=tokens, max_tokens=0, n=1)

        first = await controller.try_acquire(demand(80))
        assert first is not None
        assert await controller.try_acquire(demand(30)) is None  # no room
        waiter = asyncio.create_task(controller.acquire(demand(30), deadline=1e18))
        await asyncio.sleep(0)
        assert controller.queue_depth == 1
        assert await controller.try_acquire(demand(10)) is None  # room, but one waits
        assert await controller.try_acquire(demand(1000)) is None  # never fits: no error
        first.release()
        second = await asyncio.wait_for(waiter, 1)
        assert await controller.try_acquire(demand(10)) is not None
        second.release()

    asyncio.run(scenario())


# ------------------------------------------------------------------ the bound itself


@functools.cache
def counter(name: str) -> TokenCounter:
    loaded = load_counter(MODELS / name, name=name)
    assert isinstance(loaded, TokenCounter)
    return loaded


BOUNDED = ["qwen3-14b", "gpt-oss-20b", "deepseek-v3"]


@pytest.mark.parametrize("name", BOUNDED)
def test_the_bound_holds_on_the_corpus(name: str) -> None:
    c = counter(name)
    bounded = 0
    for request in conversations(tools=False) + conversations(tools=True):
        chat = ChatRequest(messages=request["messages"], tools=request.get("tools"))
        rendered = c.render_for_count(chat)
        assert rendered is not None
        exact = c.count_chat(chat)
        if rendered.max_tokens is not None:
            bounded += 1
            assert rendered.max_tokens >= exact
        elif rendered.text.isascii():
            pytest.fail(f"{name}: ASCII text left without a bound")
    assert bounded >= 10


@settings(max_examples=300, deadline=None)
@given(text=st.text(min_size=0, max_size=200), name=st.sampled_from(BOUNDED),
       special=st.booleans())
def test_the_bound_holds_on_fuzzed_text(text: str, name: str, special: bool) -> None:
    encoder = counter(name)._encoder
    if special:  # added-token text: one id for many bytes
        text = f"<|im_start|>{text}<|im_end|><|endoftext|>"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return  # lone surrogates never pass validation
    bound = encoder.max_rendered_tokens(text)
    if bound is None:
        assert not text.isascii()
        return
    assert bound >= len(encoder.encode_rendered(text))


def test_no_bound_without_a_proof(monkeypatch: pytest.MonkeyPatch) -> None:
    """`tokenizers` itself (fast path off, or a SentencePiece model) claims no bound, and
    NFC tokenizers claim none for non-ASCII text."""
    monkeypatch.setenv(ENV_SWITCH, "0")
    slow = load_counter(MODELS / "qwen3-14b", name="slow")
    assert isinstance(slow, TokenCounter)
    chat = ChatRequest(messages=[{"role": "user", "content": "plain ascii"}])
    rendered = slow.render_for_count(chat)
    assert rendered is not None and rendered.max_tokens is None
    monkeypatch.delenv(ENV_SWITCH)
    gemma = load_counter(MODELS / "gemma-3-12b-it", name="gemma")
    assert isinstance(gemma, TokenCounter)
    rendered = gemma.render_for_count(chat)
    assert rendered is not None and rendered.max_tokens is None
    nfc = counter("qwen3-14b").render_for_count(
        ChatRequest(messages=[{"role": "user", "content": "क़ = U+0958"}]))
    assert nfc is not None and nfc.max_tokens is None
    tiktoken_chat = counter("gpt-oss-20b").render_for_count(
        ChatRequest(messages=[{"role": "user", "content": "क़ 東京"}]))
    assert tiktoken_chat is not None and tiktoken_chat.max_tokens is not None


def test_a_json_body_reaches_the_backend_unchanged_when_admitted_on_a_bound() -> None:
    seen: list[bytes] = []

    async def echo(request: web.Request) -> web.Response:
        seen.append(await request.read())
        return web.json_response({"choices": [], "usage": {"completion_tokens": 1}})

    raw = json.dumps({"model": MODEL, "messages": ascii_chat(20), "max_tokens": 5,
                      "temperature": 0.5}).encode()

    async def scenario() -> None:
        async with behind(echo) as stack, aiohttp.ClientSession() as s:
            async with s.post(f"{stack.url}/v1/chat/completions", data=raw,
                              headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 200
            assert await metric(s, stack, "kvgate_bound_admissions_total") == 1.0
            assert seen == [raw]

    asyncio.run(scenario())

