"""The gate alone: CPU per request with prefix sharing on against off, in one process.

`bench_peers` measures kvgate whole, over loopback HTTP, beside its peers; on a 2-core
machine its req/s moves by up to 30% from one run to the next, and a load generator, a
mock engine and kvgate share the cores. This measures only what the prefix-sharing
setting changes: one model's `Gate` (count, decide, admit, follow, release), driven
in-process with the bodies `bench_peers` sends, the two settings alternating round by
round in one process, so the ratio between them holds while the machine's noise moves
both. The send step stands in for the transport: one turn of the event loop, the reply
headers (a request admitted on a bound settles on its exact count there, as served),
one answered chunk (a streamed lease's blocks become ready), one more turn, status 200.
Leases this short rarely overlap an answered holder of the `shared` workload's system
prompt, so that workload measures the count cache's path (its segment's ids and keys
remembered), not the ledger joining it.

Not measured here: HTTP parsing, the forward and the log line's I/O (the same in both
settings). Reported per cell: median CPU microseconds per request over the rounds
(`time.process_time`), min-max, and auto / off.

    .venv/bin/python -m benchmarks.bench_gate [--requests 2000] [--rounds 6]
        [--concurrency 1 16] [--workloads unique shared]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.bench_peers import bodies, kvgate_config
from proxy.ask import Admitted, Ask, Record
from proxy.config import load_config
from proxy.gate import Gate
from proxy.metrics import Outcome
from proxy.runtime import Runtime
from proxy.validation import Endpoint, validate

MODES = ("off", "auto")


@dataclass(frozen=True, slots=True)
class Answered:
    """What the transport's send reports (`proxy.ask.Sent`)."""

    status: int = 200
    first_byte_s: float | None = 0.0
    failed_mid_stream: bool = False


async def _send(admitted: Admitted) -> Answered:
    await asyncio.sleep(0)  # the forward's turn of the loop
    await admitted.reply_headers()
    admitted.on_chunk(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n')
    await asyncio.sleep(0)  # the rest of the stream
    return Answered()


async def serve_one(gate: Gate, raw: bytes) -> Record:
    loop = asyncio.get_running_loop()
    ask = Ask(request=validate(raw, Endpoint.CHAT), raw=raw, deadline=loop.time() + 30.0)
    record = Record(request_id="bench")
    await gate.handle(ask, record, _send)
    return record


async def cpu_us_per_request(gate: Gate, batch: list[bytes], concurrency: int) -> float:
    """CPU us per request for `batch`, sent by `concurrency` closed-loop clients; every
    request must be answered (a refusal would measure something else)."""
    todo = iter(batch)

    async def client() -> None:
        for raw in todo:
            record = await serve_one(gate, raw)
            if record.outcome != Outcome.COMPLETED:
                raise RuntimeError(f"a request ended {record.outcome!r}, not completed")

    started = time.process_time()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return (time.process_time() - started) / len(batch) * 1e6


async def gates(tmp: Path) -> dict[str, tuple[Runtime, Gate]]:
    """One runtime per setting, as `bench_peers` configures kvgate (one backend with room
    for everything, adaptive, the bundled Qwen3 tokenizer)."""
    out: dict[str, tuple[Runtime, Gate]] = {}
    for mode in MODES:
        config = load_config(kvgate_config(tmp / mode, 1, "http://127.0.0.1:9",
                                           prefix_sharing=mode))
        runtime = Runtime(config)
        await runtime.start()
        out[mode] = runtime, next(iter(runtime.gates.values()))
    return out


@dataclass(slots=True)
class Cell:
    workload: str
    concurrency: int
    us: dict[str, list[float]]

    def median(self, mode: str) -> float:
        return statistics.median(self.us[mode])

    @property
    def ratio(self) -> float:
        return self.median("auto") / self.median("off")


async def run(args: argparse.Namespace) -> list[Cell]:
    cells: list[Cell] = []
    with tempfile.TemporaryDirectory() as tmp:
        served = await gates(Path(tmp))
        try:
            for workload in args.workloads:
                for c in args.concurrency:
                    cell = Cell(workload, c, {m: [] for m in MODES})
                    for rnd in range(args.rounds):
                        for k, mode in enumerate(MODES):  # fresh bodies: nothing counted yet
                            batch = bodies(workload, args.requests, stream=True,
                                           max_tokens=64, seed=1000 * rnd + 2 * c + k)
                            cell.us[mode].append(
                                await cpu_us_per_request(served[mode][1], batch, c))
                    cells.append(cell)
                    print(_row(cell), flush=True)
        finally:
            for runtime, _ in served.values():
                await runtime.close()
    return cells


def _row(cell: Cell) -> str:
    parts = [f"{cell.workload:8s} {cell.concurrency:3d}"]
    for mode in MODES:
        us = cell.us[mode]
        parts.append(f"{cell.median(mode):7.0f} ({min(us):.0f}-{max(us):.0f})")
    parts.append(f"{cell.ratio:5.2f}x")
    return " | ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000,
                        help="requests per setting per round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--workloads", nargs="+", default=["unique", "shared"],
                        choices=["unique", "shared"])
    args = parser.parse_args()
    print(f"{args.requests} requests per setting per round, {args.rounds} rounds, "
          "settings alternating; CPU us per request, median (min-max)")
    print("workload   c | off               | auto              | auto/off")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
