"""Ledger throughput and admission latency: Redis (1 and 3 replicas) vs in-memory.

Starts its own redis-server on a free loopback port. Each "replica" is a separate
process with its own RedisLedger, running reserve+release pairs in a closed loop
for a fixed time. Admission latency is one AdmissionController.acquire() on an
idle backend, with each ledger, in the same process.

Two cases with long shared prefixes (4,096 tokens: 256 blocks of 16), each against
its own baseline in the same run:

- `shared-pairs`: the cost of a reserve+release pair that brings the prefix's 256
  block keys (joining a ready holder's, or registering them first) against a pair of
  the same tokens without blocks, in memory and through Redis;
- `dispatch`: dispatch passes over a deep queue (200 waiters, 4 backends) with the
  prefix figures remembered per waiter (`proxy.prefix_view`) against scanned again
  for every waiter on every pass, as before; the two must place every waiter alike.

    .venv/bin/python -m benchmarks.bench_ledger [--seconds 5] [--concurrency 16]
        [--cases replicas,latency,shared-pairs,dispatch]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from policies.ordering import Fifo
from proxy.admission import AdmissionController, Backend, Demand, Lease
from proxy.ledger import Ledger, MemoryLedger
from proxy.prefix_view import PrefixView
from proxy.redis_ledger import RedisLedger
from tests.support.redis_server import RedisServer

BLOCK = 16  # tokens per block, vLLM's default
PREFIX_BLOCKS = 256  # a 4,096-token shared prefix
CASES = ("replicas", "latency", "shared-pairs", "dispatch")


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


# ------------------------------------------------------------------ shared prefixes


def keys(group: int, n: int, first: int = 0) -> list[str]:
    """`n` block keys of 16 hex digits (the Redis ledger's width), distinct per group."""
    return [f"{group:08x}{i:08x}" for i in range(first, first + n)]


PREFIX = tuple(keys(0xFFFF, PREFIX_BLOCKS))


def shared_demand(tail: int, tail_blocks: int = 4, output: int = 256) -> Demand:
    """A prompt of the shared prefix and `tail_blocks` blocks of its own (+1 token, so
    every full block is shareable), with `output` tokens to come."""
    blocks = PREFIX + tuple(keys(tail, tail_blocks))
    prompt = BLOCK * len(blocks) + 1
    return Demand(tokens=BLOCK * -(-(prompt + output) // BLOCK), prompt_tokens=prompt,
                  max_tokens=output, blocks=blocks, block_tokens=BLOCK)


async def pair_rate(ledger: Ledger, *, blocks: Sequence[Sequence[str]], tokens: int,
                    seconds: float, concurrency: int, backend: str = "gpu-a") -> float:
    """reserve+release pairs/s of leases of `tokens`, the n-th bringing the keys
    `blocks[n % len(blocks)]`, `concurrency` in flight; every release applied (a Redis
    ledger's queue drained) before the clock stops."""
    done = started_pairs = 0
    shared = isinstance(ledger, RedisLedger)  # in memory, nothing runs between awaits
    started = time.perf_counter()
    stop = started + seconds

    async def worker() -> None:
        nonlocal done, started_pairs
        while time.perf_counter() < stop:
            lease = uuid.uuid4().hex
            keys_of = blocks[started_pairs % len(blocks)]
            started_pairs += 1
            if await ledger.reserve(backend, lease, tokens, 10**12, keys_of, BLOCK):
                ledger.release(lease)
                done += 1
            if shared:
                await asyncio.sleep(0)  # let the release worker run

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    if isinstance(ledger, RedisLedger):
        await ledger.drain()
    return done / (time.perf_counter() - started)


@dataclass(frozen=True, slots=True)
class PairRates:
    plain: float  # pairs/s without blocks
    joined: float  # with the prefix's blocks, a ready holder's: charged once
    joined_wide: float  # the same while another lease holds 512 more blocks there
    first: float  # with a prefix of 256 blocks nobody else holds: registered and dropped


# Redis keeps a hash of up to `hash-max-listpack-entries` fields (512 by default) as a
# listpack, which every HMGET and HSET scans: a backend's block refs are one hash, and
# while it held fewer distinct blocks than that each of a pair's 256 keys cost a scan
# of them, until the ledger kept the hash a hash table (`REFS_WIDE_FIELD` in
# `proxy.redis_scripts`). `joined_wide` measures the same pair beside 512 more blocks.
_WIDE_BLOCKS = 512


async def shared_pair_rates(ledger: Ledger, *, seconds: float, concurrency: int,
                            rounds: int = 3) -> PairRates:
    """The four kinds of pair, interleaved `rounds` times after a warm-up round that
    is not counted (median of each), with `seconds` per measurement; the ledger is
    started and closed here. On a shared machine a lone measurement moves by 2x (Redis'
    own time per command did, between two runs of one kind). `first` cycles
    through 1,024 distinct prefixes, so that a pair never finds its keys still held by
    an earlier one whose release is queued (it would pay them in full, unreferenced)."""
    await ledger.start()
    tokens = shared_demand(0).tokens
    fresh = [tuple(keys(group, PREFIX_BLOCKS)) for group in range(1024)]
    wide = keys(0xFFFE, _WIDE_BLOCKS)
    kinds: dict[str, list[float]] = {"plain": [], "joined": [], "joined_wide": [], "first": []}
    brings: dict[str, list[tuple[str, ...]]] = {
        "plain": [()], "joined": [PREFIX], "joined_wide": [PREFIX], "first": fresh}

    async def hold(blocks: Sequence[str]) -> str:
        """A lease that holds `blocks` ready; -> its id."""
        lease = uuid.uuid4().hex
        if not await ledger.reserve("gpu-a", lease, BLOCK * len(blocks), 10**12, blocks,
                                    BLOCK):
            raise RuntimeError("a holder was refused")
        ledger.mark_ready(lease)
        if isinstance(ledger, RedisLedger):
            await ledger.drain()
        return lease

    try:
        for n in range(rounds + 1):
            for kind in kinds:
                holders = []
                if kind.startswith("joined"):  # another lease holds the prefix ready
                    holders.append(await hold(PREFIX))
                if kind == "joined_wide":
                    holders.append(await hold(wide))
                rate = await pair_rate(ledger, blocks=brings[kind], tokens=tokens,
                                       seconds=seconds if n else seconds / 4,
                                       concurrency=concurrency)
                if n:
                    kinds[kind].append(rate)
                for holder in holders:
                    ledger.release(holder)
                if isinstance(ledger, RedisLedger):
                    await ledger.drain()
        if isinstance(ledger, RedisLedger) and (left := await ledger.resident_now("gpu-a")):
            raise RuntimeError(f"{left} tokens still reserved after every release drained")
    finally:
        await ledger.close()
    return PairRates(*(statistics.median(v) for v in kinds.values()))


class ScanEveryPass(PrefixView):
    """The prefix figures scanned afresh on every call, as dispatch did before
    `PrefixView` remembered them per waiter: the baseline of `dispatch_passes`."""

    def held(self, backend: Backend, demand: Demand | None,
             owner: object | None = None) -> tuple[int, int]:
        return super().held(backend, demand, None)


@dataclass(frozen=True, slots=True)
class PassTimes:
    quiet_ms: float  # one dispatch pass that nothing changed before
    cycle_ms: float  # a release, the answer of the waiter it let in, a newcomer
    cycles: int
    decisions: tuple[tuple[str, str, int], ...]  # (demand's last key, backend, shared)


async def dispatch_passes(*, scan_every_pass: bool, backends: int = 4, waiters: int = 200,
                          per_backend: int = 12, cycles: int = 200, quiet: int = 50,
                          seconds: float = 30.0) -> PassTimes:
    """A deep queue of shared-prefix demands over backends full of them.

    Each backend holds `per_backend` answered leases (the prefix ready there) and
    room for no more; `waiters` wait. A cycle releases the oldest lease, which lets
    the queue's head in (a pass), answers it (a pass) and queues a newcomer (a pass):
    the depth stays. Bounded by `cycles` and by `seconds`.
    """
    ledger = MemoryLedger()
    own = shared_demand(0).tokens - BLOCK * PREFIX_BLOCKS
    bs = [Backend(name=f"gpu-{i}", url="http://127.0.0.1:1",
                  capacity_tokens=BLOCK * PREFIX_BLOCKS + per_backend * own)
          for i in range(backends)]
    decisions: list[tuple[str, str, int]] = []

    def record(kind: str, lease: Lease | None) -> None:
        if kind == "admit" and lease is not None:
            decisions.append((lease.demand.blocks[-1], lease.backend.name,
                              lease.shared_tokens))

    c = AdmissionController(model="m", ledger=ledger, ordering=Fifo(), backends=bs,
                            max_queue_depth=waiters + 8, starvation_s=1e9, on_event=record)
    if scan_every_pass:
        c.prefixes = ScanEveryPass(ledger)
    for b in bs:
        c.set_shares_prefixes(b, True)
    loop = asyncio.get_running_loop()
    live: list[Lease] = []
    seq = 0

    def demand() -> Demand:
        nonlocal seq
        seq += 1
        return shared_demand(seq)

    while (lease := await c.try_acquire(demand())) is not None:
        lease.answered()
        live.append(lease)

    async def wait(d: Demand) -> None:
        live.append(await c.acquire(d, loop.time() + 3600))

    tasks = [asyncio.ensure_future(wait(demand())) for _ in range(waiters)]
    await asyncio.sleep(0)
    await c.drain()
    if c.queue_depth != waiters:
        raise RuntimeError(f"{c.queue_depth} waiting, not {waiters}")
    try:
        t0 = time.perf_counter()
        for _ in range(quiet):
            c.kick()
            await c.drain()
        quiet_s = (time.perf_counter() - t0) / quiet
        done = 0
        spent = 0.0
        stop = time.perf_counter() + seconds
        while done < cycles and time.perf_counter() < stop:
            t0 = time.perf_counter()
            before = len(live)
            live.pop(0).release()
            await c.drain()
            await asyncio.sleep(0)  # the admitted waiter's task takes its lease
            for lease in live[before - 1:]:
                lease.answered()
            await c.drain()
            tasks.append(asyncio.ensure_future(wait(demand())))
            await asyncio.sleep(0)
            await c.drain()
            spent += time.perf_counter() - t0
            done += 1
        if c.queue_depth != waiters:
            raise RuntimeError(f"{c.queue_depth} waiting at the end, not {waiters}")
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for lease in live:
            lease.release()
    return PassTimes(quiet_ms=quiet_s * 1e3, cycle_ms=spent / max(1, done) * 1e3,
                     cycles=done, decisions=tuple(decisions))


def print_dispatch(cycles: int, seconds: float) -> None:
    """Both ways, twice, interleaved; the faster of each, and whether they agree."""
    runs: dict[bool, list[PassTimes]] = {True: [], False: []}
    for _ in range(2):
        for every_pass in (True, False):
            runs[every_pass].append(asyncio.run(dispatch_passes(
                scan_every_pass=every_pass, cycles=cycles, seconds=seconds)))
    same = all(r.decisions == runs[True][0].decisions for rs in runs.values() for r in rs)
    if not same:
        raise RuntimeError("remembered prefix figures placed a waiter differently")
    scan = min(runs[True], key=lambda r: r.cycle_ms)
    memo = min(runs[False], key=lambda r: r.cycle_ms)
    scan_q = min(r.quiet_ms for r in runs[True])
    memo_q = min(r.quiet_ms for r in runs[False])
    print("dispatch over 200 waiters of a 4,096-token shared prefix (+64 own), 4 backends "
          f"({memo.cycles} cycles; same {len(memo.decisions)} placements both ways):")
    print(f"  quiet pass : scanned {scan_q:,.2f} ms, remembered {memo_q:,.2f} ms "
          f"({scan_q / memo_q:.1f}x)")
    print(f"  cycle (release + answer + newcomer, 3 passes): scanned {scan.cycle_ms:,.2f} ms, "
          f"remembered {memo.cycle_ms:,.2f} ms ({scan.cycle_ms / memo.cycle_ms:.1f}x)")


def print_shared_pairs(url: str, seconds: float, concurrency: int) -> None:
    mem = asyncio.run(shared_pair_rates(MemoryLedger(), seconds=seconds, concurrency=1))
    red = asyncio.run(shared_pair_rates(
        RedisLedger(url, backends=["gpu-a"], key_prefix="shared"), seconds=seconds,
        concurrency=concurrency))
    print(f"reserve+release pairs/s, {shared_demand(0).tokens:,}-token leases, with and "
          f"without a {BLOCK * PREFIX_BLOCKS:,}-token ({PREFIX_BLOCKS}-block) prefix "
          "(x: the cost of a pair against one without blocks):")
    for name, r in (("memory", mem), (f"redis, {concurrency} in flight", red)):
        print(f"  {name}: no blocks {r.plain:,.0f}/s; prefix joined {r.joined:,.0f}/s "
              f"({r.plain / r.joined:.1f}x), joined beside {_WIDE_BLOCKS} more blocks "
              f"{r.joined_wide:,.0f}/s ({r.plain / r.joined_wide:.1f}x), "
              f"first holder {r.first:,.0f}/s ({r.plain / r.first:.1f}x)")

def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--cycles", type=int, default=200, help="dispatch: cycles per run")
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, of {', '.join(CASES)}")
    args = parser.parse_args()
    cases = set(args.cases.split(","))
    if unknown := cases - set(CASES):
        parser.error(f"unknown cases {sorted(unknown)}; choose from {', '.join(CASES)}")
    if "dispatch" in cases:  # no Redis: first, on a quiet machine
        print_dispatch(args.cycles, max(args.seconds, 10.0))
    if not cases & {"replicas", "latency", "shared-pairs"}:
        return
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        server.start()
        try:
            if "replicas" in cases:
                one = ops_per_s(server.url, 1, args.seconds, args.concurrency)
                three = ops_per_s(server.url, 3, args.seconds, args.concurrency)
                print(f"reserve+release pairs/s through Redis (releases applied), "
                      f"{args.concurrency} in flight each:")
                print(f"  1 replica : {one:,.0f}/s")
                print(f"  3 replicas: {three:,.0f}/s total ({three / one:.2f}x one replica)")
            if "latency" in cases:
                mem = asyncio.run(admission_latency(MemoryLedger(), args.rounds))
                red = asyncio.run(admission_latency(
                    RedisLedger(server.url, backends=["gpu-a"], key_prefix="lat"),
                    args.rounds))
                for name, xs in (("memory", mem), ("redis", red)):
                    xs.sort()
                    print(f"  acquire() {name:>6}: p50 {statistics.median(xs) * 1e6:,.0f} us, "
                          f"p99 {xs[int(0.99 * len(xs))] * 1e6:,.0f} us")
                added = (statistics.median(red) - statistics.median(mem)) * 1e6
                print(f"  added admission latency of Redis (p50): {added:,.0f} us")
            if "shared-pairs" in cases:
                print_shared_pairs(server.url, args.seconds / 2, args.concurrency)
        finally:
            server.stop()

if __name__ == "__main__":
    main()
