"""Token-count throughput: kvgate's count paths vs the raw `tokenizers` library.

All sides run in the same process on the same prompts, rounds alternating; the
ratio to raw `tokenizers` is what matters on a shared, noisy machine.

* `raw tokenizers`: `Tokenizer.encode` of the already-rendered text;
* `fast encode`: the fast byte-level BPE encoder (tiktoken's core) on the same text;
* `count, fast`: the full chat count path (render the template, split on special
  tokens, encode) on the fast path, count cache off;
* `count, tokenizers`: the same with `KVGATE_FAST_BPE=0`, count cache off;
* `count, shared sys`: the fast path with the count cache on, every chat a shared
  system prompt of the given size plus a new 40-word user message. Only the system
  prompt is warm (as it is in real traffic): every round counts 20 user messages that
  no earlier round has seen, and the cache's hit/miss counts are checked to say so.

    .venv/bin/python -m benchmarks.bench_tokenize [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer

from proxy.tokenize import ChatRequest, TokenCounter, load_counter
from proxy.tokenize.bytelevel import ENV_SWITCH

MODELS = Path(__file__).resolve().parent.parent / "models"
VOCAB = (
    "the quick brown fox jumps over a lazy dog while kv cache tokens fill GPU memory "
    "数学 東京 café naïve 🌅"
).split(" ")


def prompts(n: int, words: int, seed: int = 7) -> list[ChatRequest]:
    rng = random.Random(seed)
    return [
        ChatRequest(messages=[
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": " ".join(rng.choice(VOCAB) for _ in range(words))},
        ])
        for _ in range(n)
    ]


def shared_system(n: int, words: int, *, round_: int, seed: int = 11) -> list[ChatRequest]:
    """`n` chats: one system prompt of about `words` words (the same for every round)
    and a user message of 40 words that is new in each round (`round_` seeds it)."""
    system = " ".join(random.Random(seed).choice(VOCAB) for _ in range(words))
    rng = random.Random(f"{seed}/{round_}")
    return [
        ChatRequest(messages=[
            {"role": "system", "content": system},
            {"role": "user", "content": f"{round_}.{i}: "
                                        + " ".join(rng.choice(VOCAB) for _ in range(40))},
        ])
        for i in range(n)
    ]


def load(model: str, *, fast: bool, cache_bytes: int) -> TokenCounter:
    before = os.environ.get(ENV_SWITCH)
    os.environ[ENV_SWITCH] = "1" if fast else "0"
    try:
        counter = load_counter(MODELS / model, cache_bytes=cache_bytes)
    finally:
        if before is None:
            os.environ.pop(ENV_SWITCH, None)
        else:
            os.environ[ENV_SWITCH] = before
    assert isinstance(counter, TokenCounter)
    return counter


def row(args: argparse.Namespace, words: int, fast: TokenCounter, slow: TokenCounter,
        raw: Tokenizer) -> str:
    """One line of the table: every path on the same prompts of about `words` words."""
    batch = prompts(20, words)
    rendered = [fast.render_chat(c) for c in batch]
    tokens = sum(fast.count_chat(c) for c in batch)
    assert tokens == sum(slow.count_chat(c) for c in batch)
    # One fresh set of user messages per round; only the system prompt repeats.
    shared = [shared_system(20, words, round_=r + 1) for r in range(args.rounds)]
    shared_tokens = [sum(fast.count_chat(c) for c in chats) for chats in shared]
    cached = load(args.model, fast=True, cache_bytes=64 * 2**20)
    cached.count_chat(shared_system(1, words, round_=0)[0])  # warms the system prompt only
    encoder = fast._encoder  # no public accessor for a counter's encoder
    runs: dict[str, tuple[Callable[[], object], int]] = {
        "raw": (lambda: [raw.encode(t, add_special_tokens=False) for t in rendered], tokens),
        "fast_encode": (lambda: [encoder.encode_rendered(t) for t in rendered], tokens),
        "count_fast": (lambda: [fast.count_chat(c) for c in batch], tokens),
        "count_tokenizers": (lambda: [slow.count_chat(c) for c in batch], tokens),
    }
    rates: dict[str, list[float]] = {k: [] for k in (*runs, "count_shared")}
    for r in range(args.rounds):
        for key, (fn, n_tokens) in runs.items():
            t0 = time.perf_counter()
            fn()
            rates[key].append(n_tokens / (time.perf_counter() - t0))
        chats = shared[r]
        before = cached.cache_stats()
        t0 = time.perf_counter()
        counted = sum(cached.count_chat(c) for c in chats)
        rates["count_shared"].append(shared_tokens[r] / (time.perf_counter() - t0))
        after = cached.cache_stats()
        assert counted == shared_tokens[r]
        assert before is not None and after is not None
        # Per chat: the system prompt hits, the new user message misses.
        assert (after.hits - before.hits, after.misses - before.misses) == (len(chats),) * 2, (
            before, after)
    med = {k: statistics.median(v) for k, v in rates.items()}
    base = med["raw"]
    cells = " ".join(
        f"{med[k]:>10,.0f} {med[k] / base:>4.1f}x".rjust(width)
        for k, width in (("fast_encode", 16), ("count_fast", 16),
                         ("count_tokenizers", 18), ("count_shared", 18))
    )
    return f"{tokens // len(batch):>14,} {base:>15,.0f} {cells}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", default="qwen3-14b")
    args = parser.parse_args()
    fast = load(args.model, fast=True, cache_bytes=0)
    slow = load(args.model, fast=False, cache_bytes=0)
    raw = Tokenizer.from_file(str(MODELS / args.model / "tokenizer.json"))
    print(f"model {args.model} ({fast.encoder_description}); tokens/s, median of "
          f"{args.rounds} alternating rounds; x = ratio to raw tokenizers")
    print(f"{'prompt tokens':>14} {'raw tokenizers':>15} {'fast encode':>16} "
          f"{'count, fast':>16} {'count, tokenizers':>18} {'count, shared sys':>18}")
    for words in (200, 1000, 4000):
        print(row(args, words, fast, slow, raw))

if __name__ == "__main__":
    main()
