"""Token-count throughput: kvgate's full chat count path vs the raw tokenizer library.

Both sides run in the same process on the same prompts; the ratio is what matters on
a shared, noisy machine. The count path renders the chat template and encodes; the
raw side only encodes the already-rendered text with `tokenizers`.

    .venv/bin/python -m benchmarks.bench_tokenize [--rounds 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from tokenizers import Tokenizer

from proxy.tokenize import ChatRequest, load_counter

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", default="qwen3-14b")
    args = parser.parse_args()
    counter = load_counter(MODELS / args.model)
    raw = Tokenizer.from_file(str(MODELS / args.model / "tokenizer.json"))
    print(f"model {args.model}; median of {args.rounds} rounds, alternating")
    print(f"{'prompt tokens':>14} {'count path tok/s':>17} {'raw tok/s':>12} {'ratio':>7}")
    for words in (200, 1000, 4000):
        batch = prompts(20, words)
        rendered = [counter.render_chat(c) for c in batch]
        tokens = sum(counter.count_chat(c) for c in batch)
        ours, theirs = [], []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for c in batch:
                counter.count_chat(c)
            t1 = time.perf_counter()
            for text in rendered:
                raw.encode(text, add_special_tokens=False)
            t2 = time.perf_counter()
            ours.append(tokens / (t1 - t0))
            theirs.append(tokens / (t2 - t1))
        a, b = statistics.median(ours), statistics.median(theirs)
        print(f"{tokens // len(batch):>14,} {a:>17,.0f} {b:>12,.0f} {a / b:>7.3f}")


if __name__ == "__main__":
    main()
