"""What each engine kind asks of kvgate: safe reservation and its own length fields."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from policies.engines import EngineKind, requested_output, unsafe_for_adaptive
from policies.reservation import ReservationMode
from proxy.cli import main
from proxy.config import parse_config
from proxy.modelconfig import ConfigError
from tests.support.servers import fake_backend
from tests.support.stack import MODEL, MODELS, Stack, running_stack

LLAMA, VLLM = EngineKind.LLAMA_CPP, EngineKind.VLLM


def _model(kind: str, **extra: Any) -> dict[str, Any]:
    return {"models": [{"name": MODEL, "path": str(MODELS / MODEL), "max_model_len": 2048,
                        "deployment": {"kv_tokens": 2048},
                        "backends": [{"name": "a", "url": "http://127.0.0.1:9", "kind": kind}],
                        **extra}]}


def test_llama_cpp_backends_are_strict_and_adaptive_is_refused() -> None:
    assert unsafe_for_adaptive([VLLM, LLAMA, LLAMA]) == [LLAMA]
    assert parse_config(_model("llama.cpp"), base=Path.cwd()).models[0].reservation \
        is ReservationMode.STRICT
    assert parse_config(_model("vllm"), base=Path.cwd()).models[0].reservation \
        is ReservationMode.ADAPTIVE
    with pytest.raises(ConfigError, match=r"adaptive.*unsafe with llama\.cpp backends"):
        parse_config(_model("llama.cpp", reservation="adaptive"), base=Path.cwd())


def test_check_config_says_why_a_model_is_strict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import tomli_w

    config = tmp_path / "kvgate.toml"
    config.write_text(tomli_w.dumps(_model("llama.cpp")))
    assert main(["check-config", str(config)]) == 0
    assert "reservation: strict (only strict is safe: llama.cpp cannot preempt)" \
        in capsys.readouterr().out


def test_n_predict_wins_on_llama_cpp_only() -> None:
    assert requested_output([LLAMA], max_tokens=100, n_predict=-1) is None
    assert requested_output([LLAMA], max_tokens=100, n_predict=30) == 30
    assert requested_output([LLAMA], max_tokens=100, n_predict=None) == 100
    assert requested_output([VLLM], max_tokens=100, n_predict=-1) == 100
    assert requested_output([VLLM, LLAMA], max_tokens=100, n_predict=300) == 300
    assert requested_output([VLLM, LLAMA], max_tokens=None, n_predict=30) is None


@contextlib.asynccontextmanager
async def _behind(kind: str, bodies: list[dict[str, Any]], **kwargs: Any) -> AsyncIterator[Stack]:
    async def chat(request: web.Request) -> web.Response:
        bodies.append(json.loads(await request.read()))
        return web.json_response({"id": "x", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"},
             "finish_reason": "stop"}], "usage": {"completion_tokens": 1}})

    async with fake_backend(chat) as url, \
            running_stack(backends=0, extra_backend_urls=[url], kv_tokens=16384,
                          backend={"kind": kind}, **kwargs) as stack:
        async with asyncio.timeout(5):
            while not stack.state.backends()[0].healthy:
                await asyncio.sleep(0.02)
        yield stack


@pytest.mark.parametrize(("kind", "reserves_to_the_end"), [("llama.cpp", True), ("vllm", False)])
def test_strict_reservation_reads_the_engines_own_length_field(
    kind: str, reserves_to_the_end: bool
) -> None:
    """`n_predict: -1` makes llama.cpp run to the context's end whatever max_tokens says:
    kvgate reserves that there, and only max_tokens in front of vLLM, which ignores it."""
    bodies: list[dict[str, Any]] = []

    async def scenario() -> None:
        async with _behind(kind, bodies) as stack, aiohttp.ClientSession() as s:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 50, "n_predict": -1}
            async with s.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                prompt = int(resp.headers["x-kvgate-prompt-tokens"])
                reserved = int(resp.headers["x-kvgate-reserved-tokens"])
        assert reserved == (8192 if reserves_to_the_end else -(-(prompt + 50) // 16) * 16)
        assert bodies == [body]  # unchanged: no cap policy

    asyncio.run(scenario())


@pytest.mark.parametrize("kind", ["vllm", "llama.cpp"])
def test_max_tokens_above_the_context_is_refused_only_where_the_engine_refuses_it(
    kind: str,
) -> None:
    """vLLM refuses a max_tokens above max_model_len whatever the prompt
    (tests/test_real_vllm_limits.py); kvgate answers that itself, in its shape, before
    counting or reserving. llama.cpp serves it to the context's end: forwarded."""
    bodies: list[dict[str, Any]] = []

    async def scenario() -> None:
        async with _behind(kind, bodies) as stack, aiohttp.ClientSession() as s:
            for max_tokens, field in ((8193, "max_tokens"), (9000, "max_completion_tokens")):
                body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                        field: max_tokens}
                async with s.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                    answer = await resp.json()
                    if kind == "vllm":
                        assert resp.status == 400, answer
                        assert answer["error"]["code"] == "invalid_request"
                        assert answer["error"]["param"] == field
                        assert "x-kvgate-reserved-tokens" not in resp.headers
                    else:
                        assert resp.status == 200, answer
                        assert resp.headers["x-kvgate-reserved-tokens"] == "8192"
            # max_tokens equal to the context passes everywhere (served to the end)
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 8192}
            async with s.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
            assert stack.state.ledger.resident(stack.state.backends()[0].name) == 0
        assert len(bodies) == (1 if kind == "vllm" else 3)

    asyncio.run(scenario())


def test_an_engines_own_4xx_is_relayed_and_counted_as_refused_not_completed() -> None:
    """An engine that refuses a request itself (a 4xx: a field kvgate does not check)
    is relayed unchanged; its outcome is `upstream_refused`, and the lease is released."""

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"object": "error", "message": "no", "code": 400},
                                 status=400)

    async def scenario() -> None:
        async with fake_backend(refuse) as url, \
                running_stack(backends=0, extra_backend_urls=[url], kv_tokens=16384) as stack, \
                aiohttp.ClientSession() as s:
            async with asyncio.timeout(5):
                while not stack.state.backends()[0].healthy:
                    await asyncio.sleep(0.02)
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 5}
            async with s.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 400
                assert await resp.json() == {"object": "error", "message": "no", "code": 400}
            async with s.get(f"{stack.url}/metrics") as resp:
                text = await resp.text()
            assert ('kvgate_requests_total{model="qwen3-14b",outcome="upstream_refused"} 1.0'
                    in text)
            assert 'outcome="completed"' not in text
            assert stack.state.ledger.resident(stack.state.backends()[0].name) == 0

    asyncio.run(scenario())


def test_the_cap_rewrites_n_predict_too() -> None:
    bodies: list[dict[str, Any]] = []

    async def scenario() -> None:
        model = {"output_policy": "cap", "output_cap_tokens": 100}
        async with _behind("llama.cpp", bodies, model=model) as stack, \
                aiohttp.ClientSession() as s:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                    "n_predict": -1}
            async with s.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["x-kvgate-output-cap"] == "100"
                prompt = int(resp.headers["x-kvgate-prompt-tokens"])
                assert int(resp.headers["x-kvgate-reserved-tokens"]) == \
                    -(-(prompt + 100) // 16) * 16
        [sent] = bodies
        assert sent["n_predict"] == 100 and sent["max_tokens"] == 100

    asyncio.run(scenario())


@pytest.mark.parametrize("from_props", [False, True])
def test_no_more_requests_than_the_engine_has_slots(from_props: bool) -> None:
    """A backend with 2 slots gets at most 2 requests at once; the rest wait in kvgate's
    queue (where deadlines and priorities apply), not inside the engine."""
    running = [0]
    most = [0]

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        running[0] += 1
        most[0] = max(most[0], running[0])
        await asyncio.sleep(0.2)
        running[0] -= 1
        return web.json_response({"id": "x", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"},
             "finish_reason": "stop"}], "usage": {"completion_tokens": 1}})

    async def props(request: web.Request) -> web.Response:  # as llama-server answers
        return web.json_response({"default_generation_settings": {"n_ctx": 4096},
                                  "total_slots": 2})

    backend: dict[str, Any] = {"kind": "llama.cpp"} if from_props else {
        "kind": "llama.cpp", "slots": 2}

    async def scenario() -> None:
        async with fake_backend(chat, props=props) as url, \
                running_stack(backends=0, extra_backend_urls=[url], kv_tokens=16384,
                              backend=backend) as stack, \
                aiohttp.ClientSession() as s:
            async with asyncio.timeout(5):
                while stack.state.backends()[0].slots != 2 or \
                        not stack.state.backends()[0].healthy:
                    await asyncio.sleep(0.02)
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 5}

            async def one() -> tuple[int, float]:
                async with s.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                    await resp.read()
                    return resp.status, float(resp.headers["x-kvgate-queue-wait-ms"])

            answers = await asyncio.gather(*(one() for _ in range(6)))
            assert [status for status, _ in answers] == [200] * 6
            assert most[0] == 2
            waits = sorted(wait for _, wait in answers)
            assert waits[1] < 100 and waits[2] > 150 and waits[4] > 350  # three rounds

    asyncio.run(scenario())


def test_llama_cpp_backends_are_counted_without_the_nfc_normalizer() -> None:
    """llama.cpp skips Qwen's NFC normalizer: a decomposed accent is two code points
    there and more tokens than vLLM counts. kvgate counts as the engine behind it does:
    equal to `tokenizers` with the normalizer removed."""
    import unicodedata

    from tokenizers import Tokenizer

    from proxy.tokenize import ChatRequest, load_counter
    from tests.support.corpus import conversations

    model = MODELS / MODEL
    raw = json.loads((model / "tokenizer.json").read_text())
    assert raw["normalizer"]["type"] == "NFC"
    skipping = Tokenizer.from_str(json.dumps({**raw, "normalizer": None}))
    nfc = load_counter(model, name="nfc")
    llama = load_counter(model, name="llama", unicode_normalizer=False)
    assert "NFC normalizer skipped" in llama.encoder_description
    differ = 0
    for i, conv in enumerate(conversations(tools=False)):
        messages = [{**m, "content": unicodedata.normalize("NFD", m["content"])}
                    if isinstance(m.get("content"), str) else m for m in conv["messages"]]
        chat = ChatRequest(messages=messages)
        text = nfc.render_chat(chat)
        expected = len(skipping.encode(text, add_special_tokens=False).ids)
        assert llama.count_chat(chat) == expected, i
        differ += nfc.count_chat(chat) != expected
    assert differ > 0  # the corpus has accents: the two engines' counts do differ


def test_capacity_from_a_llama_cpp_backend_is_its_props_n_ctx() -> None:
    async def chat(request: web.Request) -> web.Response:
        return web.json_response({})

    async def props(request: web.Request) -> web.Response:  # as llama-server answers
        return web.json_response({"default_generation_settings": {"n_ctx": 4096},
                                  "total_slots": 4})

    async def scenario() -> None:
        model = {"deployment": {"capacity_from_backend": True, "block_size": 16}}
        async with fake_backend(chat, props=props) as url, \
                running_stack(backends=0, extra_backend_urls=[url], model=model,
                              backend={"kind": "llama.cpp"}) as stack:
            backend = stack.state.backends()[0]
            assert backend.capacity_tokens == 0 and not backend.healthy  # not known yet
            async with asyncio.timeout(5):
                while not backend.healthy:
                    await asyncio.sleep(0.02)
            assert (backend.capacity_tokens, backend.slots) == (4096, 4)

    asyncio.run(scenario())
