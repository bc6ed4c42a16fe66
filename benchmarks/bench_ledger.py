"""Ledger throughput and admission latency: Redis (1 and 3 replicas) vs in-memory.

Starts its own redis-server on a free loopback port. Each "replica" is a separate
process with its own RedisLedger, running reserve+release pairs in a closed loop
for a fixed time. Admission latency is one AdmissionController.acquire() on an
idle backend, with each ledger, in the same process.

    .venv/bin/python -m benchmarks.bench_ledger [--seconds 5] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from policies.ordering import Fifo
from proxy.admission import AdmissionController, Backend, Demand
from proxy.ledger import Ledger, MemoryLedger
from proxy.redis_ledger import RedisLedger
from tests.support.redis_server import RedisServer


async def _pairs(url: str, seconds: float, concurrency: int, backend: str) -> tuple[int, float]:
    """-> (pairs completed, seconds until the last release reached Redis).

    `release()` only queues the release; a pair counts once Redis has applied it, so
    the time runs until the release queue has drained.
    """
    ledger = RedisLedger(url, backends=[backend], key_prefix="bench")
    await ledger.start()
    done = 0
    started = time.perf_counter()
    stop = started + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            lease = uuid.uuid4().hex
            if await ledger.reserve(backend, lease, 16, 10**12):
                ledger.release(lease)
                done += 1
            await asyncio.sleep(0)  # let the release worker run

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await ledger.drain()
    elapsed = time.perf_counter() - started
    await ledger.close()
    return done, elapsed


async def _resident(url: str, backend: str) -> int:
    ledger = RedisLedger(url, backends=[backend], key_prefix="bench")
    await ledger.start()
    try:
        return await ledger.resident_now(backend)
    finally:
        await ledger.close()


def _replica(
    url: str, seconds: float, concurrency: int, backend: str, out: mp.Queue  # type: ignore[type-arg]
) -> None:
    out.put(asyncio.run(_pairs(url, seconds, concurrency, backend)))


def ops_per_s(url: str, replicas: int, seconds: float, concurrency: int) -> float:
    """Completed reserve+release pairs per second, all replicas together."""
    out: mp.Queue = mp.Queue()  # type: ignore[type-arg]
    procs = [mp.Process(target=_replica, args=(url, seconds, concurrency, "gpu-a", out))
             for _ in range(replicas)]
    for p in procs:
        p.start()
    results = [out.get(timeout=seconds + 60) for _ in procs]
    for p in procs:
        p.join()
    left = asyncio.run(_resident(url, "gpu-a"))
    if left:  # every counted pair must have been released in Redis
        raise RuntimeError(f"{left} tokens still reserved after every release drained")
    return sum(n for n, _ in results) / max(elapsed for _, elapsed in results)


async def admission_latency(ledger: Ledger, rounds: int) -> list[float]:
    await ledger.start()
    c = AdmissionController(model="m", ledger=ledger, ordering=Fifo(), backends=[
        Backend(name="gpu-a", url="http://127.0.0.1:1", capacity_tokens=10**9)])
    demand = Demand(tokens=512, prompt_tokens=256, max_tokens=256)
    loop = asyncio.get_running_loop()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        lease = await c.acquire(demand, loop.time() + 5)
        samples.append(time.perf_counter() - t0)
        lease.release()
        await asyncio.sleep(0)
    await ledger.close()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        server.start()
        try:
            one = ops_per_s(server.url, 1, args.seconds, args.concurrency)
            three = ops_per_s(server.url, 3, args.seconds, args.concurrency)
            print(f"reserve+release pairs/s through Redis (releases applied), "
                  f"{args.concurrency} in flight each:")
            print(f"  1 replica : {one:,.0f}/s")
            print(f"  3 replicas: {three:,.0f}/s total ({three / one:.2f}x one replica)")
            mem = asyncio.run(admission_latency(MemoryLedger(), args.rounds))
            red = asyncio.run(admission_latency(
                RedisLedger(server.url, backends=["gpu-a"], key_prefix="lat"), args.rounds))
            for name, xs in (("memory", mem), ("redis", red)):
                xs.sort()
                print(f"  acquire() {name:>6}: p50 {statistics.median(xs) * 1e6:,.0f} us, "
                      f"p99 {xs[int(0.99 * len(xs))] * 1e6:,.0f} us")
            added = (statistics.median(red) - statistics.median(mem)) * 1e6
            print(f"  added admission latency of Redis (p50): {added:,.0f} us")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
