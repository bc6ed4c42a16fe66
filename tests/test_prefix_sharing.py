"""Shared prefixes over real HTTP: kvgate in front of simulated vLLM v1 engines with
prefix caching (the simulator's block pool is vLLM's, `tests/test_sim_prefix_cache.py`).

Each test checks kvgate's charge against the engine's own answer: the tokens an
admitted request was not charged (`x-kvgate-shared-prefix-tokens`) are blocks the
engine reports as prefix-cache hits (`usage.prompt_tokens_details.cached_tokens`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from proxy.prefix_blocks import shareable_blocks
from proxy.tokenize import load_counter
from proxy.tokenize.counting import TokenCounter
from proxy.validation import ChatRequest
from tests.support.metrics import samples
from tests.support.stack import MODEL, MODELS, Stack, running_stack

SYSTEM = {"role": "system", "content": " ".join(
    f"Rule {i}: answer in plain words, cite the section, and keep it short." for i in range(40))}
URL = "/v1/chat/completions"


def chat(question: str) -> list[dict[str, str]]:
    return [SYSTEM, {"role": "user", "content": question}]


def expected_shared(first: list[dict[str, str]], second: list[dict[str, str]]) -> int:
    """Full 16-token blocks the two templated prompts have in common, the last token
    of `second` left out: what vLLM v1 can hit."""
    counter = load_counter(MODELS / MODEL, name=MODEL)
    assert isinstance(counter, TokenCounter)
    a = counter.chat_token_ids(ChatRequest(messages=tuple(first)))
    b = counter.chat_token_ids(ChatRequest(messages=tuple(second)))
    common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                  min(len(a), len(b)))
    return 16 * min(common // 16, shareable_blocks(len(b), 16))


async def open_stream(s: aiohttp.ClientSession, stack: Stack, messages: list[dict[str, str]],
                      max_tokens: int) -> tuple[aiohttp.ClientResponse, bytes]:
    """A stream through kvgate, read up to its first event (the engine has prefilled)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True}
    resp = await s.post(stack.url + URL, json=body)
    assert resp.status == 200, await resp.text()
    first = await resp.content.readuntil(b"\n\n")
    return resp, first


async def ask(s: aiohttp.ClientSession, stack: Stack, messages: list[dict[str, str]],
              max_tokens: int = 5) -> tuple[dict[str, str], dict[str, Any]]:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens}
    async with s.post(stack.url + URL, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return dict(resp.headers), await resp.json()


def test_a_request_that_shares_a_live_prefix_is_charged_only_for_the_rest() -> None:
    """A holds the system prompt's blocks (its stream is running); B, with the same
    system prompt, is not charged for them, and the engine hits exactly those."""
    shared = expected_shared(chat("What is rule 3?"), chat("And rule 7?"))
    assert shared >= 16 * 30  # the system prompt is most of it

    async def scenario() -> None:
        async with running_stack(backends=1, engine={"decode_step_ms": 5.0}) as stack, \
                aiohttp.ClientSession() as s:
            a, _ = await open_stream(s, stack, chat("What is rule 3?"), 400)
            assert a.headers["x-kvgate-shared-prefix-tokens"] == "0"  # the first pays all
            a_reserved = int(a.headers["x-kvgate-reserved-tokens"])
            headers, data = await ask(s, stack, chat("And rule 7?"))
            prompt = int(headers["x-kvgate-prompt-tokens"])
            assert int(headers["x-kvgate-shared-prefix-tokens"]) == shared
            whole = 16 * -(-(prompt + 5) // 16)
            assert int(headers["x-kvgate-reserved-tokens"]) == whole - shared
            assert data["usage"]["prompt_tokens"] == prompt
            assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == shared
            assert stack.resident() == {"sim-0": a_reserved}  # B gone, A's blocks stay
            a.close()
            async with asyncio.timeout(5):
                while stack.resident()["sim-0"]:
                    await asyncio.sleep(0.01)
            async with s.get(stack.url + "/metrics") as resp:
                text = await resp.text()
            assert f'kvgate_shared_prefix_tokens_total{{backend="sim-0"}} {float(shared)}' in text

    asyncio.run(scenario())


async def bound_admissions(s: aiohttp.ClientSession, stack: Stack) -> float:
    async with s.get(stack.url + "/metrics") as resp:
        got = samples(await resp.text())
    return sum(v for _, v in got.get("kvgate_bound_admissions_total", []))


def test_a_request_admitted_on_a_bound_registers_its_blocks_for_the_next() -> None:
    """One backend that holds no shared blocks: A (the client set max_tokens) is
    admitted on a bound of its prompt before its ids are counted, and charged its whole
    prompt; its keys, counted while the engine starts on it, are registered before its
    answer begins. B, arriving while A runs, finds blocks held, so it is counted first,
    and it shares A's: the engine hits exactly those."""
    shared = expected_shared(chat("What is rule 3?"), chat("And rule 7?"))

    async def scenario() -> None:
        async with running_stack(backends=1, engine={"decode_step_ms": 5.0}) as stack, \
                aiohttp.ClientSession() as s:
            a, _ = await open_stream(s, stack, chat("What is rule 3?"), 400)
            assert await bound_admissions(s, stack) == 1.0
            prompt = int(a.headers["x-kvgate-prompt-tokens"])
            assert a.headers["x-kvgate-shared-prefix-tokens"] == "0"
            assert int(a.headers["x-kvgate-reserved-tokens"]) == stack.resident()["sim-0"]
            ledger = stack.state.ledger
            assert ledger.shared_resident("sim-0") == 16 * shareable_blocks(prompt, 16)
            headers, data = await ask(s, stack, chat("And rule 7?"))
            assert await bound_admissions(s, stack) == 1.0  # B was counted first
            assert int(headers["x-kvgate-shared-prefix-tokens"]) == shared
            assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == shared
            a.close()
            async with asyncio.timeout(5):
                while stack.resident()["sim-0"]:
                    await asyncio.sleep(0.01)
            assert ledger.shared_resident("sim-0") == 0 and ledger.lease_count("sim-0") == 0
            # nothing held now: the next is admitted on its bound again
            headers, _ = await ask(s, stack, chat("And rule 9?"))
            assert await bound_admissions(s, stack) == 2.0
            assert headers["x-kvgate-shared-prefix-tokens"] == "0"

    asyncio.run(scenario())


def test_a_prefix_still_being_prefilled_is_charged_in_full() -> None:
    """Until A's engine has answered, its blocks may not be cached there yet (a long
    prefill runs in chunks): B, arriving meanwhile, pays for its own copy."""
    async def scenario() -> None:
        # ~700 prompt tokens at 400 tokens/s: A's first token comes after ~1.7 s
        async with running_stack(backends=1, engine={"prefill_tokens_per_s": 400.0,
                                                     "decode_step_ms": 5.0}) as stack, \
                aiohttp.ClientSession() as s:
            body = {"model": MODEL, "messages": chat("What is rule 3?"), "max_tokens": 50,
                    "stream": True}
            a = asyncio.ensure_future(s.post(stack.url + URL, json=body))
            async with asyncio.timeout(5):
                while not stack.resident()["sim-0"]:
                    await asyncio.sleep(0.01)
            headers, _ = await ask(s, stack, chat("And rule 7?"))
            assert headers["x-kvgate-shared-prefix-tokens"] == "0"
            prompt = int(headers["x-kvgate-prompt-tokens"])
            assert int(headers["x-kvgate-reserved-tokens"]) == 16 * -(-(prompt + 5) // 16)
            resp = await a
            await resp.read()

    asyncio.run(scenario())


def test_placement_goes_where_the_prefix_lives() -> None:
    """Two backends; best-fit alone would put B on the emptier-fitting one. B goes to
    the backend that holds its prefix, and the engine there hits it."""
    async def scenario() -> None:
        async with running_stack(backends=2, engine={"decode_step_ms": 5.0}) as stack, \
                aiohttp.ClientSession() as s:
            a, _ = await open_stream(s, stack, chat("What is rule 3?"), 400)
            where = {b: t for b, t in stack.resident().items() if t}
            assert len(where) == 1
            [home] = where
            for question in ("And rule 7?", "And rule 9?", "And rule 11?"):
                headers, data = await ask(s, stack, chat(question))
                assert int(headers["x-kvgate-shared-prefix-tokens"]) > 0
                assert data["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            states = [await stack.sim_state(s, i) for i in range(2)]
            finished = {f"sim-{i}": st["finished"] for i, st in enumerate(states)}
            assert finished[home] == 3 and sum(finished.values()) == 3, finished
            a.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("how", ["off", "llama.cpp"])
def test_nothing_is_shared_where_sharing_is_off_or_the_engine_keeps_no_shared_cache(
    how: str,
) -> None:
    model = {"prefix_sharing": "off"} if how == "off" else {}
    backend = {"kind": "llama.cpp"} if how == "llama.cpp" else None

    async def scenario() -> None:
        async with running_stack(backends=1, model=model, backend=backend,
                                 engine={"decode_step_ms": 5.0}) as stack, \
                aiohttp.ClientSession() as s:
            a, _ = await open_stream(s, stack, chat("What is rule 3?"), 400)
            headers, _ = await ask(s, stack, chat("And rule 7?"))
            assert "x-kvgate-shared-prefix-tokens" not in headers
            prompt = int(headers["x-kvgate-prompt-tokens"])
            assert int(headers["x-kvgate-reserved-tokens"]) == 16 * -(-(prompt + 5) // 16)
            a.close()

    asyncio.run(scenario())


def test_cache_salt_keeps_prefixes_apart() -> None:
    async def scenario() -> None:
        async with running_stack(backends=1, engine={"decode_step_ms": 5.0}) as stack, \
                aiohttp.ClientSession() as s:
            body = {"model": MODEL, "messages": chat("What is rule 3?"), "max_tokens": 400,
                    "stream": True, "cache_salt": "tenant-a"}
            a = await s.post(stack.url + URL, json=body)
            await a.content.readuntil(b"\n\n")
            other = {"model": MODEL, "messages": chat("And rule 7?"), "max_tokens": 5,
                     "cache_salt": "tenant-b"}
            async with s.post(stack.url + URL, data=json.dumps(other),
                              headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 200
                assert resp.headers["x-kvgate-shared-prefix-tokens"] == "0"
            a.close()

    asyncio.run(scenario())
