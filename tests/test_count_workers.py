"""`[server] count_workers`: counting in worker processes, over real HTTP on loopback.

The workers must exist as separate processes, do the counting, and give exactly the
counts transformers gives, with the fast encoder on and off. A worker that dies hands
its share back to the proxy's own counter, still exact, and is restarted.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.tokenize import TemplateError
from proxy.tokenize.bytelevel import ENV_SWITCH
from tests.support.corpus import WEATHER_TOOL, conversations
from tests.support.metrics import samples
from tests.support.reference import hf_count, hf_tokenizer
from tests.support.stack import MODEL, MODELS, Stack, running_stack

WORKERS = 2


@pytest.fixture(params=["fast", "tokenizers"])
def encoder_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The workers inherit the environment: both encoders are checked through them."""
    monkeypatch.setenv(ENV_SWITCH, "1" if request.param == "fast" else "0")
    return str(request.param)


def _requests(tok: Any) -> list[tuple[dict[str, Any], int]]:
    """The corpus with its reference counts; what fits the test backends' 8,192 tokens."""
    chats = conversations(tools=True)
    chats.append({"messages": [{"role": "user", "content": "Weather in Paris?"}],
                  "tools": [WEATHER_TOOL]})
    counted = [(chat, hf_count(tok, chat)) for chat in chats]
    return [(chat, n) for chat, n in counted if n < 8000]


async def _post(s: aiohttp.ClientSession, stack: Stack, path: str,
                body: dict[str, Any]) -> tuple[int, dict[str, str], dict[str, Any]]:
    async with s.post(f"{stack.url}{path}", json=body) as resp:
        return resp.status, dict(resp.headers), await resp.json()


async def _state(s: aiohttp.ClientSession, stack: Stack) -> dict[str, Any]:
    async with s.get(f"{stack.url}/admin/state") as resp:
        assert resp.status == 200
        data: dict[str, Any] = await resp.json()
        return data


def _parent_and_command(pid: int) -> tuple[int, bytes]:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1]), Path(f"/proc/{pid}/cmdline").read_bytes()


def test_workers_count_every_request_exactly(encoder_path: str) -> None:
    tok = hf_tokenizer(MODELS / MODEL)
    chats = _requests(tok)

    async def scenario() -> None:
        async with running_stack(backends=1, kv_tokens=1_000_000,
                                 server={"count_workers": WORKERS}) as stack, \
                aiohttp.ClientSession() as s:
            workers = (await _state(s, stack))["count_workers"]
            assert len(workers) == WORKERS
            for w in workers:  # live processes of their own, started by this proxy
                assert w["alive"] and w["pid"] != os.getpid()
                parent, command = _parent_and_command(w["pid"])
                assert parent == os.getpid() and b"proxy.count_workers" in command
            for chat, expected in chats:
                status, headers, body = await _post(s, stack, "/v1/chat/completions",
                                                    {"model": MODEL, "max_tokens": 4, **chat})
                assert status == 200, body
                assert headers["x-kvgate-prompt-tokens"] == str(expected)
            # completions: text gets the tokenizer's own rule, token ids count as given
            texts = ["The quick brown fox, 数学 ∑ x² 🌅", "naïve café"]
            status, headers, _ = await _post(s, stack, "/v1/completions", {
                "model": MODEL, "max_tokens": 4, "prompt": texts})
            assert status == 200
            assert headers["x-kvgate-prompt-tokens"] == str(
                sum(len(tok(t)["input_ids"]) for t in texts))
            status, headers, _ = await _post(s, stack, "/v1/completions", {
                "model": MODEL, "max_tokens": 4, "prompt": [1, 2, 3]})  # no worker needed
            assert status == 200 and headers["x-kvgate-prompt-tokens"] == "3"
            counted = [w["counted"] for w in (await _state(s, stack))["count_workers"]]
            assert sum(counted) == len(chats) + 1 and all(n > 0 for n in counted)
            # the workers' count caches show in the proxy's metrics
            async with s.get(f"{stack.url}/metrics") as resp:
                text = await resp.text()
            misses = dict((labels["model"], value) for labels, value
                          in samples(text)["kvgate_count_cache_misses_total"])
            assert misses[MODEL] > 0

    asyncio.run(scenario())


def test_template_refusal_from_a_worker_is_the_same_400() -> None:
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"messages": []}}

    async def answer(workers: int) -> tuple[int, dict[str, Any]]:
        async with running_stack(backends=1, server={"count_workers": workers}) as stack, \
                aiohttp.ClientSession() as s:
            status, _, data = await _post(s, stack, "/v1/chat/completions", body)
            return status, data

    status, data = asyncio.run(answer(1))
    assert (status, data) == asyncio.run(answer(0))
    assert status == 400 and data["error"]["code"] == "invalid_request"
    assert data["error"]["param"] == "messages"


def test_a_dead_worker_leaves_counting_exact_and_is_restarted() -> None:
    chats = _requests(hf_tokenizer(MODELS / MODEL))[:12]

    async def scenario() -> None:
        async with running_stack(backends=1, kv_tokens=1_000_000,
                                 server={"count_workers": 1}) as stack, \
                aiohttp.ClientSession() as s:
            (worker,) = (await _state(s, stack))["count_workers"]
            os.kill(worker["pid"], signal.SIGKILL)  # the proxy started it for this test
            for chat, expected in chats:  # the first may find it dying, the rest gone
                status, headers, _ = await _post(s, stack, "/v1/chat/completions",
                                                 {"model": MODEL, "max_tokens": 4, **chat})
                assert status == 200
                assert headers["x-kvgate-prompt-tokens"] == str(expected)
            async with asyncio.timeout(60):  # a new worker in its slot, loaded and counting
                while not ((now := (await _state(s, stack))["count_workers"][0])["alive"]
                           and now["pid"] != worker["pid"]):
                    await asyncio.sleep(0.05)
            assert now["restarts"] == 1
            chat, expected = chats[0]
            status, headers, _ = await _post(s, stack, "/v1/chat/completions",
                                             {"model": MODEL, "max_tokens": 4, **chat})
            assert status == 200 and headers["x-kvgate-prompt-tokens"] == str(expected)
            assert (await _state(s, stack))["count_workers"][0]["counted"] == 1

    asyncio.run(scenario())


def test_workers_give_block_keys_and_prefixes_are_shared() -> None:
    """With count workers the shared-prefix keys come from them: the same keys as the
    proxy's own counter gives (chat and completions), and a second chat with the same
    system prompt, while the first holds its blocks, is charged only for the rest."""
    from proxy.count_workers import CountWorkers
    from proxy.tokenize import ChatRequest, TokenCounter, load_counter

    system = {"role": "system", "content": " ".join(
        f"Rule {i}: answer in plain words and keep it short." for i in range(40))}
    first = [system, {"role": "user", "content": "What is rule 3?"}]
    second = [system, {"role": "user", "content": "And rule 7?"}]
    counter = load_counter(MODELS / MODEL, name=MODEL)
    assert isinstance(counter, TokenCounter)
    scope = f"{MODEL}\0salt"

    async def direct() -> None:
        workers = CountWorkers({MODEL: str(MODELS / MODEL)}, 1)
        await workers.start()
        try:
            for messages in (first, second, first):
                body = json.dumps({"model": MODEL, "messages": messages}).encode()
                got = await workers.count_keys("chat", body, 16, scope)
                assert got == counter.count_chat_keys(ChatRequest(messages=messages), 16,
                                                      scope)
                assert got is not None and len(got[1]) > 20
            body = json.dumps({"model": MODEL, "prompt": "The quick brown fox " * 30}).encode()
            assert await workers.count_keys("completions", body, 4, scope) == \
                counter.count_prompt_keys("The quick brown fox " * 30, 4, scope)
            body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                               "chat_template_kwargs": {"messages": []}}).encode()
            with pytest.raises(TemplateError):
                await workers.count_keys("chat", body, 16, scope)
            (worker,) = workers.describe()
            assert worker["counted"] == 4
        finally:
            await workers.close()

    asyncio.run(direct())

    async def over_http() -> None:
        async with running_stack(backends=1, server={"count_workers": 1},
                                 engine={"decode_step_ms": 5.0}) as stack, \
                aiohttp.ClientSession() as s:
            body = {"model": MODEL, "messages": first, "max_tokens": 400, "stream": True}
            a = await s.post(stack.url + "/v1/chat/completions", json=body)
            assert a.status == 200
            await a.content.readuntil(b"\n\n")  # prefilled: its blocks are cached
            status, headers, data = await _post(s, stack, "/v1/chat/completions",
                                                {"model": MODEL, "messages": second,
                                                 "max_tokens": 5})
            assert status == 200, data
            shared = int(headers["x-kvgate-shared-prefix-tokens"])
            assert shared >= 16 * 20
            assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == shared
            assert (await _state(s, stack))["count_workers"][0]["counted"] == 2
            a.close()

    asyncio.run(over_http())


def test_a_panic_in_a_keys_job_is_count_failed() -> None:
    """The worker's side of a keys job: a tokenizer panic is `count_failed` (the proxy's
    `CountFailed`, a 500 that reaches no backend), and the worker goes on."""
    from proxy.count_workers import _answer, _keys_job
    from proxy.tokenize import load_counter

    counter = load_counter(MODELS / MODEL, name=MODEL)
    panic = type("PanicException", (BaseException,), {"__module__": "pyo3_runtime"})

    def explode(text: str) -> list[int]:
        raise panic("core gave up")

    counter._segments._encode = explode  # type: ignore[attr-defined]
    body = json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": "count me " * 20}]}).encode()
    answer = _answer({MODEL: counter}, _keys_job(16, MODEL) + b"c" + body)
    assert "panicked" in answer["count_failed"]
