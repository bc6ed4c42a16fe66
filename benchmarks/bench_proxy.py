"""Proxy overhead: kvgate vs a direct connection to the same simulated backend, one run.

The simulated backend and the proxy run as their own processes (`kvgate sim`,
`kvgate serve`) on 127.0.0.1; this process is the client. For each mode
(streaming or not) and concurrency, the same bounded number of requests goes
direct and through kvgate, alternating rounds so machine noise hits both.
Reported: p50/p99 latency each way, the added latency, and the throughput ratio.

    .venv/bin/python -m benchmarks.bench_proxy [--requests 400] [--concurrency 1 32]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import tomli_w

from benchmarks.suite.report import pct
from proxy.ports import free_port
from proxy.stack import spawn_logged, stop_process, wait_port

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "models" / "qwen3-14b"



@contextlib.contextmanager
def process(args: list[str], port: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`python -m proxy ARGS` until the block ends; its output goes to `log`."""
    proc = spawn_logged([sys.executable, "-m", "proxy", *args], log)
    try:
        wait_port(port, proc, args[0])
        yield proc
    finally:
        stop_process(proc)


def ms(values: list[float], q: float) -> float:
    """The q-quantile in ms (NaN for no values)."""
    value = pct(values, q)
    return math.nan if value is None else value * 1000


async def load(url: str, *, requests: int, concurrency: int, stream: bool,
               max_tokens: int) -> tuple[list[float], float]:
    body = {"model": "qwen3-14b", "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": "Summarise the KV cache in one line."}]}
    latencies: list[float] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def worker() -> None:
            while not queue.empty():
                queue.get_nowait()
                t0 = time.perf_counter()
                async with s.post(f"{url}/v1/chat/completions", json=body) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"status {resp.status}")
                latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        async with asyncio.timeout(300):
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, requests / (time.perf_counter() - t0)


async def compare(direct: str, proxied: str, args: argparse.Namespace) -> None:
    print(f"{args.requests} requests per cell, max_tokens {args.max_tokens}, "
          f"sim decode step {args.decode_step_ms} ms; latencies in ms")
    print(f"{'mode':<10}{'conc':>5} {'direct p50':>11} {'p99':>8} {'kvgate p50':>11} "
          f"{'p99':>8} {'added p50':>10} {'added p99':>10} {'thru ratio':>11}")
    for stream in (False, True):
        for conc in args.concurrency:
            kw = {"requests": args.requests // 2, "concurrency": conc, "stream": stream,
                  "max_tokens": args.max_tokens}
            d_lat: list[float] = []
            p_lat: list[float] = []
            d_tp: list[float] = []
            p_tp: list[float] = []
            await load(direct, **kw)  # warm up connections and caches
            await load(proxied, **kw)
            for _ in range(2):  # alternate so drift hits both sides
                lat, tp = await load(direct, **kw)
                d_lat += lat
                d_tp.append(tp)
                lat, tp = await load(proxied, **kw)
                p_lat += lat
                p_tp.append(tp)
            d50, d99 = ms(d_lat, 0.5), ms(d_lat, 0.99)
            p50, p99 = ms(p_lat, 0.5), ms(p_lat, 0.99)
            ratio = statistics.mean(p_tp) / statistics.mean(d_tp)
            print(f"{'stream' if stream else 'json':<10}{conc:>5} {d50:>11.2f} {d99:>8.2f} "
                  f"{p50:>11.2f} {p99:>8.2f} {p50 - d50:>10.2f} {p99 - d99:>10.2f} "
                  f"{ratio:>11.3f}")


@contextlib.contextmanager
def kvgate_before_sim(*, decode_step_ms: float, model: dict[str, object] | None = None,
                      max_model_len: int = 8192) -> Iterator[tuple[str, str]]:
    """A simulated backend with room to spare and kvgate in front, each its own process;
    -> (the backend's URL, kvgate's)."""
    sim_port, proxy_port = free_port(), free_port()
    sim_url = f"http://127.0.0.1:{sim_port}"
    proxy_url = f"http://127.0.0.1:{proxy_port}"
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "kvgate.toml"
        config.write_text(tomli_w.dumps({
            "server": {"listen": f"127.0.0.1:{proxy_port}"},
            "queue": {"max_depth": 1024},
            "models": [{"name": "qwen3-14b", "path": str(MODEL_DIR),
                        "max_model_len": max_model_len,
                        "deployment": {"kv_tokens": 1_000_000},
                        "backends": [{"name": "sim", "url": sim_url}], **(model or {})}],
        }))
        with process(["sim", "--port", str(sim_port), "--kv-tokens", "1000000",
                      "--model", "qwen3-14b", "--model-dir", str(MODEL_DIR),
                      "--output-len", "max", "--decode-step-ms", str(decode_step_ms),
                      "--max-model-len", str(max_model_len)], sim_port, Path(tmp) / "sim.log"), \
                process(["serve", "--config", str(config)], proxy_port,
                        Path(tmp) / "kvgate.log"):
            yield sim_url, proxy_url


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--decode-step-ms", type=float, default=1.0)
    args = parser.parse_args()
    with kvgate_before_sim(decode_step_ms=args.decode_step_ms) as (sim_url, proxy_url):
        asyncio.run(compare(sim_url, proxy_url, args))


if __name__ == "__main__":
    main()
