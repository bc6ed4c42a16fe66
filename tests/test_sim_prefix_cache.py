"""The simulator's prefix caching, rule by rule, against hand-worked examples.

Engine examples use blocks of 4 tokens and a pool of a few blocks, and step the engine
by hand (schedule, grow, emit: one engine step, without the clock). Blocks are named
b0, b1, ... by id; the pool hands them out from the head of its free queue, which
starts as b0, b1, b2, ...
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.cli import build_parser
from proxy.sim.engine import EngineConfig, OutputLength, Sequence, SimEngine
from proxy.sim.kv_cache import (
    ROOT_HASH,
    block_hashes_from_hash_ids,
    hash_block_tokens,
    hash_prompt_blocks,
)
from tests.support.metrics import samples
from tests.support.reference import hf_tokenizer
from tests.support.servers import running_sim

MODELS = Path(__file__).resolve().parent.parent / "models"


def engine(num_blocks: int, **config: Any) -> SimEngine:
    return SimEngine(EngineConfig(kv_tokens=4 * num_blocks, block_size=4,
                                  output_length=OutputLength.MAX, **config))


def submit(e: SimEngine, ids: list[int], max_tokens: int) -> Sequence:
    return e.submit(prompt_tokens=len(ids), max_tokens=max_tokens, out=asyncio.Queue(),
                    prompt_token_ids=ids)


def step(e: SimEngine) -> int:
    """One engine step; returns the tokens it prefilled."""
    prefill = e._schedule()
    e._grow()
    e._emit()
    return prefill


def ids_of(seq: Sequence) -> list[int]:
    return [b.block_id for b in seq.block_table]


def r(a: int, b: int) -> list[int]:
    return list(range(a, b + 1))


# ---------------------------------------------------------------- the hash chain
def test_only_full_blocks_are_hashed_each_by_its_parent_and_its_tokens() -> None:
    h1 = hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    h2 = hash_block_tokens(h1, [5, 6, 7, 8])
    assert hash_prompt_blocks(r(1, 10), 4) == [h1, h2]  # tokens 9, 10: no full block
    assert hash_prompt_blocks(r(1, 3), 4) == []
    # the same first block, another second one
    assert hash_prompt_blocks([1, 2, 3, 4, 9, 9, 9, 9], 4)[0] == h1
    assert hash_prompt_blocks([1, 2, 3, 4, 9, 9, 9, 9], 4)[1] != h2
    # the same tokens after another prefix are another block
    assert hash_prompt_blocks([5, 6, 7, 8], 4) != [h2]


def test_hashes_are_the_same_in_every_process() -> None:
    code = ("from proxy.sim.kv_cache import hash_prompt_blocks as h;"
            "print(h(list(range(40)), 16))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
            for seed in ("1", "2")}
    assert outs == {f"{hash_prompt_blocks(list(range(40)), 16)}\n"}


def test_trace_hash_ids_become_engine_block_hashes() -> None:
    # one hash id per 8 tokens, blocks of 4, a 14-token prompt: 3 full engine blocks
    # (tokens 0-3 and 4-7 in id 7, 8-11 in the next id; 12-13 make no full block)
    a = block_hashes_from_hash_ids([7, 8], hash_id_tokens=8, block_size=4, prompt_tokens=14)
    b = block_hashes_from_hash_ids([7, 9], hash_id_tokens=8, block_size=4, prompt_tokens=14)
    c = block_hashes_from_hash_ids([9, 8], hash_id_tokens=8, block_size=4, prompt_tokens=14)
    assert len(a) == len(b) == len(c) == 3
    assert a[:2] == b[:2] and a[2] != b[2]
    assert not set(a) & set(c)
    # ids covering fewer tokens than the prompt: only the blocks they cover
    assert len(block_hashes_from_hash_ids([7], hash_id_tokens=8, block_size=4,
                                          prompt_tokens=14)) == 2


# ---------------------------------------------------------------- sharing
def test_a_shared_prefix_is_held_once_and_prefilled_once() -> None:
    e = engine(8)
    a = submit(e, r(1, 10), max_tokens=4)
    assert step(e) == 10  # nothing cached yet: all 10 prompt tokens computed
    assert ids_of(a) == [0, 1, 2]  # 3 blocks for 11 tokens (prompt + this step's)
    assert a.cached_tokens == 0

    # B: the same first 8 tokens (A's 2 full blocks), then its own 2
    b = submit(e, [*r(1, 8), 11, 12], max_tokens=4)
    assert step(e) == 2  # only the uncached tokens are prefilled
    assert b.cached_tokens == 8
    assert ids_of(b) == [0, 1, 3]  # b0, b1 shared, one new block
    assert [blk.ref_cnt for blk in b.block_table] == [2, 2, 1]
    assert e.blocks_used == 4  # not 6: a shared block is held once
    assert (e.prefix_cache_queries, e.prefix_cache_hits) == (20, 8)

    # C: exactly A's first 8 tokens. A hit may not cover the last prompt token, so
    # at most 7 tokens, rounded down to whole blocks: b0 only; its second block is
    # computed again into a block of its own (under the same hash, as vLLM does)
    c = submit(e, r(1, 8), max_tokens=4)
    assert step(e) == 4
    assert c.cached_tokens == 4
    assert ids_of(c)[0] == 0 and ids_of(c)[1] not in (1, 3)
    assert a.block_table[0].ref_cnt == 3
    assert c.block_table[1].block_hash == a.block_table[1].block_hash
    distinct = {blk.block_id for s in (a, b, c) for blk in s.block_table}
    assert e.blocks_used == len(distinct)
    assert (e.prefix_cache_queries, e.prefix_cache_hits) == (28, 12)


def test_without_prefix_caching_nothing_is_shared() -> None:
    e = engine(8, prefix_caching=False)
    a = submit(e, r(1, 10), max_tokens=2)
    b = submit(e, [*r(1, 8), 11, 12], max_tokens=2)
    assert step(e) == 20
    assert (a.cached_tokens, b.cached_tokens) == (0, 0)
    assert (ids_of(a), ids_of(b)) == ([0, 1, 2], [3, 4, 5])
    assert e.blocks_used == 6
    step(e)
    assert e.blocks_used == 0
    assert e.blocks_cached_free == 0  # their blocks went back unnamed
    assert (e.prefix_cache_queries, e.prefix_cache_hits) == (0, 0)
    c = submit(e, r(1, 10), max_tokens=1)
    assert step(e) == 10
    assert c.cached_tokens == 0


# ---------------------------------------------------------------- release, LRU, eviction
def test_released_blocks_stay_cached_and_the_lru_head_is_evicted_first() -> None:
    e = engine(4)
    a = submit(e, r(1, 8), max_tokens=1)
    assert step(e) == 8
    # A took b0, b1 (its 2 full prompt blocks, cached) and b2 for its next token, then
    # finished: freed tail first, its blocks join the free queue's tail as b2, b1, b0
    assert a.finish_reason is not None
    assert e.pool.free_block_ids() == [3, 2, 1, 0]
    assert e.blocks_used == 0
    assert e.blocks_cached_free == 2  # b1, b0: free, yet still named
    assert e.kv_cache_usage == 0.0  # cached-but-free blocks count as free

    # D (11 unrelated tokens) needs 3 blocks: b3, b2 (never named) and b1, whose
    # name (A's second block) is dropped; A's first block b0 survives
    d = submit(e, r(50, 60), max_tokens=1)
    assert step(e) == 11
    assert ids_of(d) == [] and e.pool.evictions == 1
    assert e.pool.free_block_ids() == [0, 1, 2, 3]  # D freed its b1, b2, b3 tail first

    # E shares A's 8 tokens: b0 still hits, A's second block is gone
    e_seq = submit(e, [*r(1, 8), 9], max_tokens=1)
    assert step(e) == 5
    assert e_seq.cached_tokens == 4
    assert e.prefix_cache_hits == 4


def test_a_hit_on_a_free_cached_block_costs_a_block_but_no_compute() -> None:
    e = engine(4)
    submit(e, r(1, 8), max_tokens=1)
    step(e)  # A ran and finished: b1, b0 cached and free; queue b3, b2, b1, b0
    f = submit(e, r(100, 104), max_tokens=2)  # 5 tokens: holds b3, b2 for two steps
    assert step(e) == 5
    assert ids_of(f) == [3, 2]
    # G shares A's 8 tokens and adds one: 3 blocks, of which 2 are hits. Only 1 is
    # new, but the 2 hits are free blocks, taken out of the free queue: 3 > 2 free
    g = submit(e, [*r(1, 8), 9], max_tokens=2)
    assert step(e) == 0
    assert e.num_waiting == 1 and f.finish_reason is not None
    assert e.pool.evictions == 0  # waiting evicted nothing
    assert step(e) == 1  # F gone: G starts, computing only its 9th token
    assert g.cached_tokens == 8
    assert ids_of(g)[:2] == [0, 1]


def test_preemption_drops_references_and_the_recompute_hits_what_is_still_cached() -> None:
    e = engine(4)
    a = submit(e, r(1, 4), max_tokens=8)
    b = submit(e, r(11, 14), max_tokens=8)
    assert step(e) == 8
    assert (ids_of(a), ids_of(b)) == ([0, 2], [1, 3])
    for _ in range(3):
        assert step(e) == 0
    # 8 tokens each; A's next needs a 3rd block, none is free: B, the newest, is
    # preempted. Its blocks go back tail first, b3 (unnamed), then b1 (its prompt
    # block, named), and A takes b3
    step(e)
    assert b.preemptions == 1 and e.num_waiting == 1
    assert ids_of(b) == [] and ids_of(a) == [0, 2, 3]
    assert e.pool.free_block_ids() == [1]
    assert e.blocks_cached_free == 1
    # B's recompute needs 2 blocks: its cached prompt block b1 (free: it costs one)
    # and one more; 1 is free, so it waits for A
    prefills = []
    while b.block_table == []:
        prefills.append(step(e))
    assert a.finish_reason is not None
    # then it hits b1 and recomputes only its 4 generated tokens
    assert prefills[-1] == 4
    assert ids_of(b)[0] == 1
    # vLLM counts a preempted request's lookups apart from the exported ones
    assert (e.prefix_cache_queries, e.prefix_cache_hits) == (8, 0)
    assert (e.prefix_cache_preempted_queries, e.prefix_cache_preempted_hits) == (8, 4)
    assert b.cached_tokens == 0  # what its first scheduling found
    while b.finish_reason is None:
        step(e)
    assert b.generated == 8
    assert e.blocks_used == 0 and e.invariant_violations == 0


# ---------------------------------------------------------------- the submit API
def test_block_hashes_share_like_token_ids_and_bad_input_is_refused() -> None:
    e = engine(16)
    hashes = hash_prompt_blocks(r(1, 10), 4)
    submit(e, r(1, 10), max_tokens=4)
    step(e)
    trace = e.submit(prompt_tokens=10, max_tokens=4, out=asyncio.Queue(),
                     block_hashes=hashes)
    assert step(e) == 2 and trace.cached_tokens == 8
    counted = e.submit(prompt_tokens=10, max_tokens=4, out=asyncio.Queue())
    assert step(e) == 10 and counted.cached_tokens == 0  # no ids: nothing to share
    q: asyncio.Queue[tuple[int, int | None]] = asyncio.Queue()
    with pytest.raises(ValueError, match="not both"):
        e.submit(prompt_tokens=10, max_tokens=4, out=q, prompt_token_ids=r(1, 10),
                 block_hashes=hashes)
    with pytest.raises(ValueError, match="9 prompt_token_ids"):
        e.submit(prompt_tokens=10, max_tokens=4, out=q, prompt_token_ids=r(1, 9))
    with pytest.raises(ValueError, match="3 block_hashes for a prompt of 2 full blocks"):
        e.submit(prompt_tokens=11, max_tokens=4, out=q, block_hashes=[*hashes, 5])


# ---------------------------------------------------------------- over HTTP
SYSTEM = {"role": "system", "content": "s" * 800}  # 200 tokens by the estimate
QUESTIONS = ("Alpha?", "Bravo!", "Charlie.")


def three_chats(**extra: Any) -> list[dict[str, Any]]:
    return [{"model": "sim-model", "max_tokens": 3,
             "messages": [SYSTEM, {"role": "user", "content": q}], **extra}
            for q in QUESTIONS]


async def post(s: aiohttp.ClientSession, base: str, body: dict[str, Any]) -> dict[str, Any]:
    async with s.post(f"{base}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        data: dict[str, Any] = await resp.json()
        return data


async def metrics(s: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    async with s.get(f"{base}/metrics") as resp:
        got = samples(await resp.text())
    return {name: values[0][1] if name != "vllm:cache_config_info" else values[0][0]
            for name, values in got.items()}


def test_three_chats_sharing_a_system_prompt_over_http() -> None:
    # The estimate: 2 tokens, then 4 + 200 for the system message and 4 for the user's
    # role are shared (210); each question adds 2. 212-token prompts, blocks of 16:
    # 13 full shared blocks, 208 tokens, under the 211 a hit may reach.
    async def scenario() -> None:
        async with running_sim(kv_tokens=4096, block_size=16) as base, \
                aiohttp.ClientSession() as s:
            first, second, third = three_chats()
            usages = [(await post(s, base, body))["usage"] for body in (first, second)]
            stream = {**third, "stream": True, "stream_options": {"include_usage": True}}
            async with s.post(f"{base}/v1/chat/completions", json=stream) as resp:
                lines = [line async for line in resp.content if line.startswith(b"data: {")]
            usages.append(json.loads(lines[-1][6:])["usage"])
            assert [u["prompt_tokens"] for u in usages] == [212, 212, 212]
            assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [
                0, 208, 208]
            got = await metrics(s, base)
            assert got["vllm:prefix_cache_queries_total"] == 3 * 212
            assert got["vllm:prefix_cache_hits_total"] == 2 * 208
            assert got["vllm:cache_config_info"]["enable_prefix_caching"] == "True"
            # all finished: nothing referenced, the shared blocks and each one's
            # own full blocks still cached (13 + 3 x 0: 212 tokens make 13 full blocks)
            assert got["vllm:kv_cache_usage_perc"] == 0.0
            assert got["sim:num_gpu_blocks_cached_free"] == 13

    asyncio.run(scenario())


def test_concurrent_chats_hit_blocks_cached_in_the_same_step() -> None:
    # vLLM names a block when it allocates it for the step that computes it, so of
    # three requests scheduled together the first computes and the others hit.
    async def scenario() -> None:
        async with running_sim(kv_tokens=4096, block_size=16) as base, \
                aiohttp.ClientSession() as s:
            answers = await asyncio.gather(*(post(s, base, b) for b in three_chats()))
            cached = sorted(a["usage"]["prompt_tokens_details"]["cached_tokens"]
                            for a in answers)
            assert cached == [0, 208, 208]

    asyncio.run(scenario())


def test_no_prefix_caching_gives_no_hits_and_the_old_answers() -> None:
    async def scenario() -> None:
        async with running_sim(kv_tokens=4096, block_size=16,
                               prefix_caching=False) as base, \
                aiohttp.ClientSession() as s:
            for body in three_chats():
                assert (await post(s, base, body))["usage"] == {
                    "prompt_tokens": 212, "completion_tokens": 3, "total_tokens": 215}
            got = await metrics(s, base)
            assert got["vllm:prefix_cache_queries_total"] == 0
            assert got["vllm:prefix_cache_hits_total"] == 0
            assert got["vllm:cache_config_info"]["enable_prefix_caching"] == "False"
            assert got["sim:num_gpu_blocks_cached_free"] == 0

    asyncio.run(scenario())


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_real_tokenizer_ids_name_the_blocks() -> None:
    """With a model directory the rendered chat's real ids are hashed: the expected hits
    follow from transformers' ids, not from the simulator's own counter."""
    tok = hf_tokenizer(MODELS / "qwen3-14b")
    system = {"role": "system", "content": "You are a careful assistant. " * 40}
    chats = [[system, {"role": "user", "content": q}] for q in QUESTIONS]
    ids = []
    for messages in chats:
        rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids.append(list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered))
    expected = [0] + [
        min(max(_common(ids[k], ids[j]) for j in range(k)), len(ids[k]) - 1) // 16 * 16
        for k in (1, 2)]
    assert expected[1] > 200

    async def scenario() -> None:
        async with running_sim(kv_tokens=8192, model="qwen3",
                               model_dir=str(MODELS / "qwen3-14b")) as base, \
                aiohttp.ClientSession() as s:
            got = []
            for messages in chats:
                body = {"model": "qwen3", "messages": messages, "max_tokens": 2}
                got.append((await post(s, base, body))["usage"])
            assert [u["prompt_tokens"] for u in got] == [len(i) for i in ids]
            assert [u["prompt_tokens_details"]["cached_tokens"] for u in got] == expected
            # a completion prompt's text goes through the tokenizer too
            text = "The quick brown fox jumps over the lazy dog. " * 20
            for tail in ("One.", "Two."):
                async with s.post(f"{base}/v1/completions", json={
                        "model": "qwen3", "prompt": text + tail, "max_tokens": 1}) as resp:
                    usage = (await resp.json())["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= 192

    asyncio.run(scenario())


def test_cli_flag() -> None:
    base = ["sim", "--port", "1", "--kv-tokens", "64"]
    assert build_parser().parse_args(base).prefix_caching is True
    assert build_parser().parse_args([*base, "--no-prefix-caching"]).prefix_caching is False
