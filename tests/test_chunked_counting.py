"""Long prompts counted chunk by chunk: exact, stopped once past the context, stopped
with their client, and taking turns in the count pool.

A long segment is cut only where `proxy.tokenize.chunked.Cuts` proves the ids do not
change; the cut is checked here at every cut point of random text drawn from every
character class the split patterns treat apart, per bundled tokenizer, and the
chunked counts and block keys against the one-call paths and transformers.
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.tokenize import ChatRequest, PromptCounter, TokenCounter, load_counter
from proxy.tokenize.base import Encoder
from proxy.tokenize.bytelevel import ByteLevelBPEEncoder
from proxy.tokenize.cache import SegmentCounter
from proxy.tokenize.chunked import CHUNK_CHARS, CountExceeded
from proxy.tokenize.fair_pool import counting_for
from proxy.tokenize.guard import CORE_RUN
from tests.support.metrics import samples
from tests.support.reference import hf_count, hf_tokenizer
from tests.support.stack import MODEL, MODELS, running_stack

# (model directory, tiktoken encoding): every bundled tokenizer with a proven split
CUT = [("qwen3-14b", None), ("deepseek-v3", None), ("gpt-oss-20b", None),
       ("tiktoken", "cl100k_base"), ("tiktoken", "o200k_base")]
TOKENIZER_JSON = ["qwen3-14b", "deepseek-v3", "gpt-oss-20b", "gemma-3-12b-it"]

# Letters (Latin, accented, decomposed, CJK, Hangul jamo), digits, contractions, symbols,
# '/', every whitespace kind, controls and format characters (DeepSeek's gaps), emoji.
PIECES = [*"abXYZé한中文字0129!.,'-/_()#\n\r\t \u00a0\u3000\u2003\x0b\x0c\x85\u2028\u200b",
          *"\x01\ue000\u0301\u1100\u1161😀", " 's", "'ll", "don't", "\r\n", "  ", "\n\n",
          " \n", "\t\n", "//", "-->", "123456"]


def synchronously(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """An async test run in its own event loop (as the other counting tests do)."""
    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))
    return run


@functools.cache
def counter(name: str, encoding: str | None = None) -> PromptCounter:
    return load_counter(MODELS / name, encoding=encoding)


def encoder_of(name: str, encoding: str | None = None) -> Encoder:
    c = counter(name, encoding)
    assert isinstance(c, TokenCounter)
    return c._encoder


def text_of(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        piece = rng.choice(PIECES)
        out.append(piece)
        size += len(piece)
    return "".join(out)


def unique_words(rng: random.Random, chars: int) -> str:
    return " ".join(f"w{rng.getrandbits(40):x}" for _ in range(chars // 12))


@pytest.mark.parametrize(("name", "encoding"), CUT)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(PIECES), min_size=1, max_size=40))
def test_every_cut_leaves_the_ids_unchanged(name: str, encoding: str | None,
                                            pieces: list[str]) -> None:
    enc = encoder_of(name, encoding)
    assert enc.cuts is not None
    text = "".join(pieces)
    whole = enc.encode_segment(text)
    assert len(whole) >= enc.min_rendered_tokens(text)
    at = 1
    while (cut := enc.cuts.next_cut(text, at)) is not None:
        assert 0 < cut < len(text)
        assert enc.encode_segment(text[:cut]) + enc.encode_segment(text[cut:]) == whole, cut
        at = cut + 1


def test_cuts_are_found_in_prose_and_code() -> None:
    """Chunks stay near their size: prose has a cut before nearly every space, code
    after nearly every line."""
    enc = encoder_of("qwen3-14b")
    assert enc.cuts is not None
    prose = "the KV cache holds every token " * 5000
    assert enc.cuts.next_cut(prose, 1000) in range(1000, 1010)
    code = "\n".join(f"x{i}=f(y[{i}])" for i in range(5000))
    assert enc.cuts.next_cut(code, 1000) in range(1000, 1020)
    assert enc.cuts.next_cut(" " * 5000, 10) is None  # no cut inside a whitespace run


@pytest.mark.parametrize("name", TOKENIZER_JSON)
@synchronously
async def test_chunked_counts_and_keys_equal_the_one_call_paths(name: str) -> None:
    rng = random.Random(7)
    text = text_of(rng, 5 * CHUNK_CHARS // 2) + unique_words(rng, 2 * CHUNK_CHARS)
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": text}]
    chat = ChatRequest(messages=messages, source_bytes=len(text) * 2)
    fresh = load_counter(MODELS / name)  # its own cache: nothing counted before
    assert isinstance(fresh, TokenCounter)
    reference = counter(name)
    assert isinstance(reference, TokenCounter)
    exact = len(reference.chat_token_ids(chat))
    assert exact == hf_count(hf_tokenizer(MODELS / name), {"messages": messages})
    assert await fresh.count_chat_async(chat) == exact
    assert await fresh.count_chat_async(chat) == exact  # from the count cache now
    assert (await fresh.count_chat_keys_async(chat, 16, "s")
            == reference.count_chat_keys(chat, 16, "s"))
    assert await fresh.count_prompt_async(text) == len(reference.prompt_token_ids(text))
    assert (await fresh.count_prompt_keys_async(text, 16, "s")
            == reference.count_prompt_keys(text, 16, "s"))


@pytest.mark.parametrize(("name", "encoding"), CUT)
@synchronously
async def test_tiktoken_and_byte_level_plain_prompts_keep_their_special_token_rule(
        name: str, encoding: str | None) -> None:
    """A completion prompt holding special-token text: tiktoken counts it as text, the
    tokenizer.json models split it out, and a BOS rule applies once, chunked or not."""
    c = counter(name, encoding)
    assert isinstance(c, TokenCounter)
    special = "<|im_start|>" if name == "qwen3-14b" else "<|endoftext|>"
    text = (unique_words(random.Random(3), 3 * CHUNK_CHARS) + special) * 2
    assert await c.count_prompt_async(text) == c.count_prompt(text)


@pytest.fixture
def chunks_encoded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Every chunk's start, as `SegmentCounter.encode_chunk` is called."""
    calls: list[int] = []
    original = SegmentCounter.encode_chunk

    def spy(self: SegmentCounter, segment: str, start: int, *args: Any) -> Any:
        calls.append(start)
        return original(self, segment, start, *args)

    monkeypatch.setattr(SegmentCounter, "encode_chunk", spy)
    yield calls


def big_chat(chars: int, seed: int = 1) -> ChatRequest:
    text = unique_words(random.Random(seed), chars)
    return ChatRequest(messages=[{"role": "user", "content": text}], source_bytes=chars)


def test_counting_in_this_thread_stops_once_past_the_limit_too(
        chunks_encoded: list[int]) -> None:
    """The count workers' path (`count_chat(chat, limit)`): the same plan, run inline."""
    c = load_counter(MODELS / MODEL)
    assert isinstance(c, TokenCounter)
    chat = big_chat(4_000_000)
    with pytest.raises(CountExceeded) as stopped:
        c.count_chat(chat, 40_959)
    assert stopped.value.at_least > 40_959 and len(chunks_encoded) <= 4
    with pytest.raises(CountExceeded):
        c.count_prompt_keys(chat.messages[0]["content"], 16, "s", 40_959)
    small = big_chat(300_000)
    assert c.count_chat(small, 10**6) == c.count_chat(small)
    text = small.messages[0]["content"]
    assert c.count_prompt_keys(text, 16, "s", 10**6) == c.count_prompt_keys(text, 16, "s")
    assert c.count_chat_keys(small, 16, "s", 10**6) == c.count_chat_keys(small, 16, "s")


@synchronously
async def test_counting_stops_once_past_the_limit(chunks_encoded: list[int]) -> None:
    c = load_counter(MODELS / MODEL)
    chat = big_chat(4_000_000)
    exact = c.count_chat(chat)  # one call, no chunks
    assert chunks_encoded == []
    with pytest.raises(CountExceeded) as stopped:
        await c.count_chat_async(chat, 40_959)
    assert 40_959 < stopped.value.at_least <= exact
    # a chunk of unique words holds ~20k tokens or more: 61 chunks, three pass 40,959
    assert len(chunks_encoded) <= 4
    with pytest.raises(CountExceeded):
        await c.count_prompt_async(chat.messages[0]["content"], 40_959)
    assert len(chunks_encoded) <= 8


@synchronously
async def test_a_text_its_length_proves_too_long_is_not_encoded(
        chunks_encoded: list[int]) -> None:
    """4 MB holds at least 4M / 128 tokens (Qwen3's longest token is 128 bytes)."""
    c = load_counter(MODELS / MODEL)
    chat = big_chat(4_000_000)
    with pytest.raises(CountExceeded) as stopped:
        await c.count_chat_keys_async(chat, 16, "s", 8191)
    assert stopped.value.at_least == -(-len(c.render_chat(chat)) // 128)
    assert chunks_encoded == []


@synchronously
async def test_a_cancelled_count_encodes_no_further_chunk(chunks_encoded: list[int]) -> None:
    c = load_counter(MODELS / MODEL)
    task = asyncio.ensure_future(c.count_chat_async(big_chat(4_000_000)))
    async with asyncio.timeout(30):
        while len(chunks_encoded) < 2:
            await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    at_cancel = len(chunks_encoded)
    await asyncio.sleep(0.3)
    assert len(chunks_encoded) == at_cancel  # of the 61 chunks of the text
    assert at_cancel < 20


@synchronously
async def test_long_counts_take_turns_with_a_shorter_one() -> None:
    """Two 4 MB counts hold both pool threads; one 200 kB count started after them ends
    first: each chunk queues at the pool's tail (one call each would have held both
    threads for the whole 4 MB)."""
    c = load_counter(MODELS / MODEL)
    longs = [asyncio.ensure_future(c.count_chat_async(big_chat(4_000_000, seed)))
             for seed in (11, 12)]
    await asyncio.sleep(0.05)
    short = await c.count_chat_async(big_chat(200_000, 13))
    assert short > 40_000
    assert not any(t.done() for t in longs)
    await asyncio.gather(*longs)


@pytest.mark.parametrize("workers", [0, 1])
@synchronously
async def test_over_http_a_long_prompt_is_refused_before_it_is_counted_whole(
        workers: int) -> None:
    """kvgate serving, counting in its own process or in a count worker: 600 kB of
    unique words (past 8,192 tokens after one chunk) is a 400 context_length_exceeded
    saying where counting stopped; nothing reaches the backend and no lease is left."""
    text = unique_words(random.Random(5), 600_000)
    exact = counter(MODEL).count_prompt(text)
    async with running_stack(backends=1, kv_tokens=65536,
                             server={"count_workers": workers}) as stack, \
            aiohttp.ClientSession() as s:
        for path, body in (("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": text}]}),
                           ("/v1/completions", {"prompt": text})):
            async with s.post(f"{stack.url}{path}",
                              json={"model": MODEL, "max_tokens": 8, **body}) as resp:
                assert resp.status == 400
                error = (await resp.json())["error"]
            assert error["code"] == "context_length_exceeded"
            assert "at least" in error["message"], error["message"]
            at_least = int(error["message"].split("at least ")[1].split()[0])
            assert 8192 <= at_least < exact / 5  # a chunk or two of the ten there are
        state = await stack.sim_state(s, 0)
        assert state["finished"] == 0 and state["running"] == 0 and state["waiting"] == 0
        assert stack.resident() == {"sim-0": 0}
        async with s.get(f"{stack.url}/metrics") as resp:
            metrics = samples(await resp.text())
        refused = [v for labels, v in metrics["kvgate_rejections_total"]
                   if labels.get("reason") == "context_length_exceeded"]
        assert sum(refused) == 2



def test_a_run_too_long_for_the_core_goes_to_the_call_that_releases_the_gil(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A whitespace run of more than `CORE_RUN` characters: `encode_single_piece` held
    the GIL for its whole BPE (4 MB of spaces and tabs: 2.5 s with every other thread,
    the event loop's included, stopped); `tokenizers`' `encode_batch` gives the same ids
    and releases it (bench_hostile's `spaces` attack measures the difference)."""
    enc = encoder_of(MODEL)
    assert isinstance(enc, ByteLevelBPEEncoder)
    cutter = enc._cutter
    assert cutter is not None and cutter._long_run == enc._reference_run
    runs: list[int] = []

    def spy(run: str) -> list[int]:
        runs.append(len(run))
        return enc._reference_run(run)

    monkeypatch.setattr(cutter, "_long_run", spy)
    text = "x" + (" " * 63 + "\t") * (CORE_RUN // 32) + "x"
    ids = enc.encode_segment(text)
    assert runs == [len(text) - 3]  # the run less its last character, which goes with "x"
    assert ids == enc._ref.encode_segment(text)  # `tokenizers` on the whole text


@synchronously
async def test_clients_take_turns_in_the_count_pool(chunks_encoded: list[int],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Tenant "a" counts four long prompts at once, tenant "b" one: a free thread goes
    to the waiting tenant with the fewest jobs running, so "a" gets two to three chunks
    to each of "b"'s (2.0-2.7 measured; by request it would get four, and with more
    prompts more; `proxy.tokenize.fair_pool` says why not one)."""
    c = load_counter(MODELS / MODEL)
    owner: dict[str, str] = {}  # a prompt's first words -> its tenant
    original = SegmentCounter.encode_chunk
    done_by: list[str] = []

    def spy(self: SegmentCounter, segment: str, start: int, *args: Any) -> Any:
        done_by.append(next(t for head, t in owner.items() if head in segment[:100]))
        return original(self, segment, start, *args)

    monkeypatch.setattr(SegmentCounter, "encode_chunk", spy)

    async def count(tenant: str, seed: int) -> None:
        counting_for.set(tenant)
        chat = big_chat(2_000_000, seed)
        owner[chat.messages[0]["content"][:60]] = tenant
        await c.count_chat_async(chat)

    a = [asyncio.ensure_future(count("a", seed)) for seed in range(20, 24)]
    await count("b", 30)
    by_a, by_b = done_by.count("a"), done_by.count("b")
    await asyncio.gather(*a)
    assert by_b >= 25  # 2 MB: about 30 chunks
    assert by_a <= 2.9 * by_b, (by_a, by_b)  # by request: 4 to 1
