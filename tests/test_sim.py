"""The simulated GPU backend over real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.sim.engine import EngineConfig, OutputLength, SimEngine
from proxy.tokenize import ChatRequest, load_counter
from tests.support.servers import running_sim

MODELS = Path(__file__).resolve().parent.parent / "models"


def chat_body(content: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": content}], **extra}


async def state(session: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    async with session.get(f"{base}/sim/state") as resp:
        data: dict[str, Any] = await resp.json()
        return data


async def read_sse(resp: aiohttp.ClientResponse) -> list[Any]:
    events: list[Any] = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            payload = line[6:]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_sim_finish_reason_and_usage_exact_with_real_tokenizer() -> None:
    async def scenario() -> None:
        counter = load_counter(MODELS / "qwen3-14b")
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        expected_prompt = counter.count_chat(ChatRequest(messages=msgs))
        async with running_sim(kv_tokens=4096, output_length=OutputLength.MAX,
                               model="qwen3", model_dir=str(MODELS / "qwen3-14b")) as base, \
                aiohttp.ClientSession() as s:
            body = {"model": "qwen3", "messages": msgs, "max_tokens": 7}
            async with s.post(f"{base}/v1/chat/completions", json=body) as resp:
                data = await resp.json()
            assert data["choices"][0]["finish_reason"] == "length"
            assert data["usage"] == {"prompt_tokens": expected_prompt, "completion_tokens": 7,
                                     "total_tokens": expected_prompt + 7}
            body = {**body, "stream": True, "stream_options": {"include_usage": True}}
            async with s.post(f"{base}/v1/chat/completions", json=body) as resp:
                events = await read_sse(resp)
            assert events[-1] == "[DONE]"
            content = [e["choices"][0]["delta"].get("content") for e in events[1:-1]
                       if e["choices"] and e["choices"][0]["delta"].get("content")]
            assert len(content) == 7
            assert events[-3]["choices"][0]["finish_reason"] == "length"
            assert events[-2]["usage"]["completion_tokens"] == 7

    asyncio.run(scenario())


def test_sim_lognormal_lengths_stop_before_max_and_are_seeded() -> None:
    async def lengths(seed: int) -> list[tuple[str, int]]:
        async with running_sim(kv_tokens=100_000, seed=seed) as base, \
                aiohttp.ClientSession() as s:
            out = []
            for _ in range(12):
                async with s.post(f"{base}/v1/chat/completions",
                                  json=chat_body(max_tokens=400)) as resp:
                    data = await resp.json()
                choice = data["choices"][0]
                out.append((choice["finish_reason"], data["usage"]["completion_tokens"]))
            return out

    first = asyncio.run(lengths(3))
    assert first == asyncio.run(lengths(3))
    assert any(reason == "stop" and n < 400 for reason, n in first)
    for reason, n in first:
        assert (reason == "length") == (n == 400)


def test_sim_n_choices_and_completions_default_16() -> None:
    async def scenario() -> None:
        async with running_sim(kv_tokens=4096, output_length=OutputLength.MAX) as base, \
                aiohttp.ClientSession() as s:
            async with s.post(f"{base}/v1/chat/completions",
                              json=chat_body(max_tokens=5, n=3)) as resp:
                data = await resp.json()
            assert sorted(c["index"] for c in data["choices"]) == [0, 1, 2]
            assert data["usage"]["completion_tokens"] == 15
            async with s.post(f"{base}/v1/completions",
                              json={"model": "sim-model", "prompt": [1, 2, 3]}) as resp:
                data = await resp.json()
            assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 16,
                                     "total_tokens": 19}

    asyncio.run(scenario())


def test_sim_request_larger_than_pool_is_an_error_not_a_hang() -> None:
    async def scenario() -> None:
        async with running_sim(kv_tokens=256) as base, aiohttp.ClientSession() as s:
            async with asyncio.timeout(5), s.post(
                f"{base}/v1/chat/completions", json=chat_body(max_tokens=1000)
            ) as resp:
                assert resp.status == 400
                data = await resp.json()
            assert "can never fit the KV cache of 256 tokens" in data["error"]["message"]

    asyncio.run(scenario())


async def _burst(base: str, count: int, max_tokens: int) -> tuple[float, dict[str, Any]]:
    async with aiohttp.ClientSession() as s:
        peak = 0

        async def one() -> float:
            t0 = time.perf_counter()
            async with s.post(f"{base}/v1/chat/completions",
                              json=chat_body("x" * 400, max_tokens=max_tokens)) as resp:
                data = await resp.json()
            assert data["choices"][0]["finish_reason"] == "length"
            return time.perf_counter() - t0

        async def sample() -> None:
            nonlocal peak
            while True:
                st = await state(s, base)
                peak = max(peak, st["blocks_used"])
                assert st["blocks_used"] <= st["num_blocks"]
                await asyncio.sleep(0.005)

        sampler = asyncio.create_task(sample())
        async with asyncio.timeout(60):
            latencies = await asyncio.gather(*(one() for _ in range(count)))
        sampler.cancel()
        final = await state(s, base)
        final["sampled_peak"] = peak
        return max(latencies), final


def test_sim_overload_preempts_and_slows_under_pool_does_not() -> None:
    async def scenario() -> None:
        cfg = {"kv_tokens": 1024, "output_length": OutputLength.MAX,
               "decode_step_ms": 1.0, "per_seq_ms": 0.05}
        async with running_sim(**cfg) as base:
            # 3 requests x (106 prompt + 100 out) = 618 tokens resident: under the pool
            calm_latency, calm = await _burst(base, 3, 100)
        async with running_sim(**cfg) as base:
            # 24 requests x 306 tokens = 7,344 resident demand: 7x the pool
            busy_latency, busy = await _burst(base, 24, 200)
        assert calm["preemptions"] == 0
        assert busy["preemptions"] > 0
        for st in (calm, busy):
            assert st["invariant_violations"] == 0
            assert st["peak_blocks_used"] <= st["num_blocks"] == 64
            assert st["blocks_used"] == 0
        assert busy_latency > 2 * calm_latency

    asyncio.run(scenario())


def test_sim_client_disconnect_frees_blocks() -> None:
    async def scenario() -> None:
        async with running_sim(kv_tokens=4096, output_length=OutputLength.MAX,
                               decode_step_ms=5) as base, aiohttp.ClientSession() as s:
            resp = await s.post(f"{base}/v1/chat/completions",
                                json=chat_body(max_tokens=2000, stream=True))
            await resp.content.readline()
            assert (await state(s, base))["blocks_used"] > 0
            resp.close()  # the client goes away mid-stream
            async with asyncio.timeout(5):
                while (st := await state(s, base))["blocks_used"] or st["running"]:
                    await asyncio.sleep(0.02)
            assert st["generation_tokens_total"] < 2000

    asyncio.run(scenario())


def test_sim_metrics_use_vllm_names_and_models_health() -> None:
    async def scenario() -> None:
        async with running_sim(kv_tokens=4096, block_size=16) as base, \
                aiohttp.ClientSession() as s:
            async with s.post(f"{base}/v1/chat/completions", json=chat_body(max_tokens=3)):
                pass
            async with s.get(f"{base}/metrics") as resp:
                text = await resp.text()
            for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                         "vllm:num_requests_waiting", "vllm:num_preemptions_total",
                         "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
                assert f"\n{name}{{" in "\n" + text, name
            assert 'vllm:cache_config_info{block_size="16",num_gpu_blocks="256"' in text
            async with s.get(f"{base}/v1/models") as resp:
                assert (await resp.json())["data"][0]["id"] == "sim-model"
            async with s.get(f"{base}/health") as resp:
                assert resp.status == 200
            async with s.post(f"{base}/v1/chat/completions", data=b"{bad") as resp:
                assert resp.status == 400

    asyncio.run(scenario())


def test_engine_preempts_newest_and_recomputes() -> None:
    async def scenario() -> None:
        engine = SimEngine(EngineConfig(kv_tokens=64, block_size=16,
                                        output_length=OutputLength.MAX))
        engine.start()
        q: asyncio.Queue[tuple[int, int | None]] = asyncio.Queue()
        a = engine.submit(prompt_tokens=16, max_tokens=32, out=q, index=0)
        b = engine.submit(prompt_tokens=16, max_tokens=32, out=q, index=1)
        done = 0
        async with asyncio.timeout(5):
            while done < 2:
                if (await q.get())[1] is None:
                    done += 1
        await engine.stop()
        # 4 blocks; each needs 3 at the end: b (newest) must have been preempted.
        assert a.preemptions == 0
        assert b.preemptions >= 1
        assert (a.generated, b.generated) == (32, 32)
        assert engine.blocks_used == 0
        assert engine.invariant_violations == 0

    asyncio.run(scenario())


def test_engine_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        EngineConfig(kv_tokens=8)
    with pytest.raises(ValueError, match="`decode_step_ms` must be >= 0"):
        EngineConfig(kv_tokens=64, decode_step_ms=-1)
