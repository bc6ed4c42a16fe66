"""Simulated backend throughput: output tokens/s with 64 concurrent streams, zero step delay.

The engine and the client share one process and one core-bound event loop, so the
figure is a floor for what the simulator sustains.

    .venv/bin/python -m benchmarks.bench_sim [--streams 64] [--max-tokens 200]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import aiohttp

from proxy.sim.engine import EngineConfig, OutputLength
from proxy.sim.server import SimSettings, bound_port, start_sim


async def run(streams: int, max_tokens: int, rounds: int) -> None:
    settings = SimSettings(engine=EngineConfig(kv_tokens=1_000_000,
                                               output_length=OutputLength.MAX))
    runner = await start_sim(settings, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{bound_port(runner)}"
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens, "stream": True}
    try:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=streams)
        ) as session:

            async def one() -> int:
                chunks = 0
                async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
                    async for line in resp.content:
                        text = line.replace(b'"content":""', b"")
                        if line.startswith(b"data: {") and b'"content":"' in text:
                            chunks += 1
                return chunks

            for r in range(rounds):
                t0 = time.perf_counter()
                async with asyncio.timeout(120):
                    counts = await asyncio.gather(*(one() for _ in range(streams)))
                elapsed = time.perf_counter() - t0
                tokens = sum(counts)
                assert tokens == streams * max_tokens, tokens
                print(f"round {r}: {streams} streams, {tokens:,} tokens in {elapsed:.2f} s "
                      f"= {tokens / elapsed:,.0f} output tokens/s")
    finally:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(run(args.streams, args.max_tokens, args.rounds))


if __name__ == "__main__":
    main()
