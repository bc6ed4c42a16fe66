"""kvgate next to its peers: direct, a minimal aiohttp pass-through proxy, and kvgate.

Three targets in one run, interleaved cell by cell so machine noise hits all of them
(each cell's rounds alternate the order of the targets, ABBA, so a target's place in
the round does not pass for its speed):

* `direct`: a zero-delay OpenAI-compatible mock (answers at once; streams
  `max_tokens` SSE chunks back to back);
* `floor`: the thinnest useful Python proxy, aiohttp in and out with one shared
  `ClientSession` and nothing else; what any Python proxy pays before doing work;
* `kvgate`: `kvgate serve` with the memory ledger and the bundled Qwen3 tokenizer,
  one backend with room for everything, so nothing queues; `reservation = "adaptive"`
  is written in its config (and the `--baseline` kvgate's), so a change of the default
  mode cannot pass for a change of code. `--kvgate-env` applies to both kvgates.

Workloads: (a) `unique`: a different ~1,000-token prompt per request; (b) `shared`:
one ~1,000-token system prompt plus a new ~50-token user message per request, as
chats with a common system prompt send. At concurrency 1, 16 and 64, JSON and
streaming. Reported per cell: req/s, ratio to direct and to the floor, the proxy
process's CPU ms per request (from /proc), added p50/p99 latency over direct.

Every server runs as its own process on 127.0.0.1 (uvloop where installed, as
kvgate does); this process is the closed-loop client. Every cell is bounded in
requests and in time.

    .venv/bin/python -m benchmarks.bench_peers [--requests 600] [--concurrency 1 16 64]
    .venv/bin/python -m benchmarks.bench_peers --baseline /tmp/kvgate-main  # a 2nd checkout
    .venv/bin/python -m benchmarks.bench_peers --kvgate-env KVGATE_FAST_BPE=0
    .venv/bin/python -m benchmarks.bench_peers --profile kvgate.svg   # py-spy, if installed
    .venv/bin/python -m benchmarks.bench_peers --modes stream --concurrency 16  # one cell
    .venv/bin/python -m benchmarks.bench_peers --engine vllm --concurrency 1 4 8 \\
        --requests 48 --max-tokens 32   # direct: one vLLM CPU server (a few minutes)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import tomli_w
from aiohttp import web

from benchmarks.suite.report import pct
from proxy.ports import free_port
from proxy.stack import stop_process, wait_port

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "models" / "qwen3-14b"
MODEL = "qwen3-14b"
CELL_TIMEOUT_S = 120.0
VOCAB = (
    "the quick brown fox jumps over a lazy dog while the cache holds tokens for every "
    "request in flight and the scheduler decides who runs next on the GPU memory budget "
    "latency throughput admission queue deadline prompt answer model server proxy"
).split()


# ----------------------------------------------------------------------------- servers


def new_loop() -> asyncio.AbstractEventLoop:
    """uvloop where installed (aiohttp's documented fast loop), else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def mock_app() -> web.Application:
    """A zero-delay OpenAI-compatible chat endpoint: the ceiling every proxy is held to."""
    created = int(time.time())

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n_out = int(body.get("max_tokens") or 16)
        usage = {"prompt_tokens": 1000, "completion_tokens": n_out,
                 "total_tokens": 1000 + n_out}
        if not body.get("stream"):
            return web.json_response({
                "id": "cmpl-mock", "object": "chat.completion", "created": created,
                "model": body.get("model"),
                "choices": [{"index": 0, "finish_reason": "length",
                             "message": {"role": "assistant", "content": "tok " * n_out}}],
                "usage": usage,
            })
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = json.dumps({"id": "cmpl-mock", "object": "chat.completion.chunk",
                            "created": created, "model": body.get("model"),
                            "choices": [{"index": 0, "delta": {"content": "tok "},
                                         "finish_reason": None}]})
        line = f"data: {chunk}\n\n".encode()
        for _ in range(n_out):
            await resp.write(line)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    # No /metrics: adaptive kvgate's engine poll gets a 404 every 0.5 s and skips that
    # backend's report. An empty 200 would instead count as quiet scrapes that loosen
    # the admission target, which a mock with no KV cache cannot vouch for; with room
    # for 100M tokens no target binds either way.
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    return app


def floor_app(upstream: str, close: bool = False) -> web.Application:
    """A pass-through proxy with nothing in it: read, forward, stream back. `close`: a
    fresh upstream connection per request (llama-server closes its connection after
    every streamed answer; a reused one fails)."""
    session_key = web.AppKey("session", aiohttp.ClientSession)
    hop = {"content-length", "transfer-encoding", "connection", "keep-alive"}

    async def ctx(app: web.Application) -> Any:
        app[session_key] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=close),
            timeout=aiohttp.ClientTimeout(total=None))
        yield
        await app[session_key].close()

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with request.app[session_key].post(
            upstream + "/v1/chat/completions", data=body,
            headers={"Content-Type": "application/json"},
        ) as up:
            resp = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() not in hop})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    app = web.Application()
    app.cleanup_ctx.append(ctx)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def serve_role(role: str, port: int, upstream: str, close: bool = False) -> None:
    app = mock_app() if role == "mock" else floor_app(upstream, close)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, loop=new_loop())


# ----------------------------------------------------------------------------- processes



@contextlib.contextmanager
def process(args: list[str], port: int, what: str, env: dict[str, str] | None = None,
            cwd: Path = ROOT) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, *args], cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, **(env or {})})
    try:
        wait_port(port, proc, what, timeout_s=60)
        yield proc
    finally:
        stop_process(proc, signal.SIGINT)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all threads, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def machine_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine since boot, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields[:8])  # guest time is already inside user
    return total - idle, total


def children_cpu_seconds(pid: int) -> float:
    """CPU of a process's live children (kvgate's count workers), from /proc."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        if int(fields[1]) == pid:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


# ----------------------------------------------------------------------------- load


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(n))


# Fields every body carries (`--engine llama.cpp` sets llama-server's: greedy, no
# prompt-cache reuse, so each request is prefilled and runs its whole max_tokens).
EXTRA_BODY: dict[str, Any] = {}


def bodies(workload: str, count: int, *, stream: bool, max_tokens: int,
           seed: int) -> list[bytes]:
    """Request bodies; `unique`: ~1,000 fresh tokens each; `shared`: one system prompt."""
    rng = random.Random(seed)
    system = words(random.Random(0), 900)
    out = []
    for i in range(count):
        if workload == "unique":
            messages = [{"role": "user", "content": f"request {seed}-{i}: {words(rng, 900)}"}]
        else:
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": f"request {seed}-{i}: {words(rng, 40)}"}]
        out.append(json.dumps({"model": MODEL, "messages": messages,
                               "max_tokens": max_tokens, "stream": stream,
                               **EXTRA_BODY}).encode())
    return out


@dataclass
class Cell:
    latencies_s: list[float] = field(default_factory=list)
    rps: float = 0.0
    cpu_ms_per_request: float | None = None
    workers_cpu_ms_per_request: float | None = None  # kvgate's count workers, if any
    loop_busy: float | None = None  # the server process's CPU seconds per second
    machine_busy: float | None = None  # share of all cores busy (every process) in the cell
    errors: int = 0


def _pct(values: list[float], q: float) -> float:
    """`pct`, NaN for no values (a cell whose every request failed)."""
    value = pct(values, q)
    return math.nan if value is None else value


async def load(session: aiohttp.ClientSession, url: str, payloads: list[bytes],
               concurrency: int, pid: int | None) -> Cell:
    cell = Cell()
    it = iter(payloads)
    headers = {"Content-Type": "application/json"}

    async def worker() -> None:
        for payload in it:
            t0 = time.perf_counter()
            async with session.post(url + "/v1/chat/completions", data=payload,
                                    headers=headers) as resp:
                await resp.read()
                if resp.status != 200:
                    cell.errors += 1
            cell.latencies_s.append(time.perf_counter() - t0)

    cpu0 = cpu_seconds(pid) if pid else 0.0
    kids0 = children_cpu_seconds(pid) if pid else 0.0
    busy0, total0 = machine_ticks()
    t0 = time.perf_counter()
    async with asyncio.timeout(CELL_TIMEOUT_S):
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    busy1, total1 = machine_ticks()
    cell.machine_busy = (busy1 - busy0) / max(1, total1 - total0)
    cell.rps = len(cell.latencies_s) / elapsed
    if pid:
        cell.cpu_ms_per_request = (cpu_seconds(pid) - cpu0) * 1000 / len(cell.latencies_s)
        cell.loop_busy = (cpu_seconds(pid) - cpu0) / elapsed
        cell.workers_cpu_ms_per_request = (
            (children_cpu_seconds(pid) - kids0) * 1000 / len(cell.latencies_s))
    return cell


TARGETS = ("direct", "floor", "kvgate")
BASELINE = "baseline"  # --baseline DIR: another kvgate checkout, e.g. before a change


# Seeds per repeat: each `--repeat` sends prompts no earlier one sent. With one seed
# sequence for all, repeats 2 and 3 re-sent repeat 1's "unique" prompts, and a count
# cache that still held them skipped the count: one holding more entries (counts
# only, as with sharing off or at bde6de9) hit more than one holding ids (sharing on),
# so later repeats compared cache sizes, not code.
SEEDS_PER_REPEAT = 1_000_000


async def run_all(urls: dict[str, str], pids: dict[str, int | None],
                  args: argparse.Namespace, repeat: int = 0) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    seed = 1 + repeat * SEEDS_PER_REPEAT
    # against a real engine every target gets a fresh connection per request: the
    # engine closes its own after each streamed answer, and so `direct` must
    connector = aiohttp.TCPConnector(limit=0, force_close=args.engine is not None)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        for workload in args.workloads:
            for stream in (mode == "stream" for mode in args.modes):
                for conc in args.concurrency:
                    n = args.requests if conc > 1 else max(50, args.requests // 4)
                    cells: dict[str, Cell] = {t: Cell() for t in urls}
                    # warm up connections, the kvgate template, the count cache
                    for target in urls:
                        warm = bodies(workload, min(n, 2 * conc), stream=stream,
                                      max_tokens=args.max_tokens, seed=seed)
                        seed += 1
                        await load(session, urls[target], warm, conc, None)
                    for r in range(args.rounds):  # interleave so drift hits every target
                        # and alternate the order (ABBA): in a fixed order, the same code
                        # as kvgate and as --baseline read 0.82-0.92x three runs in a
                        # row (stream, c=64), the place in the round as much as the code
                        for target in (list(urls) if r % 2 == 0 else list(urls)[::-1]):
                            payloads = bodies(workload, n // args.rounds, stream=stream,
                                              max_tokens=args.max_tokens, seed=seed)
                            seed += 1
                            got = await load(session, urls[target], payloads, conc,
                                             pids[target])
                            c = cells[target]
                            c.latencies_s += got.latencies_s
                            c.rps += got.rps / args.rounds
                            c.errors += got.errors
                            if got.cpu_ms_per_request is not None:
                                c.cpu_ms_per_request = (c.cpu_ms_per_request or 0.0) + (
                                    got.cpu_ms_per_request / args.rounds)
                            c.machine_busy = (c.machine_busy or 0.0) + (
                                (got.machine_busy or 0.0) / args.rounds)
                            if got.loop_busy is not None:
                                c.loop_busy = (c.loop_busy or 0.0) + got.loop_busy / args.rounds
                            if got.workers_cpu_ms_per_request is not None:
                                c.workers_cpu_ms_per_request = (
                                    (c.workers_cpu_ms_per_request or 0.0)
                                    + got.workers_cpu_ms_per_request / args.rounds)
                    row = _row(workload, stream, conc, cells)
                    rows.append(row)
                    _print_row(row)
    return rows


def _row(workload: str, stream: bool, conc: int, cells: dict[str, Cell]) -> dict[str, Any]:
    d = cells["direct"]
    row: dict[str, Any] = {"workload": workload, "stream": stream, "concurrency": conc}
    for t, c in cells.items():
        row[t] = {
            "rps": round(c.rps, 1),
            "p50_ms": round(_pct(c.latencies_s, 0.5) * 1000, 3),
            "p99_ms": round(_pct(c.latencies_s, 0.99) * 1000, 3),
            "added_p50_ms": round((_pct(c.latencies_s, 0.5) - _pct(d.latencies_s, 0.5)) * 1000,
                                  3),
            "added_p99_ms": round((_pct(c.latencies_s, 0.99) - _pct(d.latencies_s, 0.99))
                                  * 1000, 3),
            "vs_direct": round(c.rps / d.rps, 3),
            "vs_floor": round(c.rps / cells["floor"].rps, 3),
            # the whole process tree: the server and, for kvgate, its count workers
            "cpu_ms_per_request": (round(c.cpu_ms_per_request
                                         + (c.workers_cpu_ms_per_request or 0.0), 3)
                                   if c.cpu_ms_per_request is not None else None),
            "loop_busy": round(c.loop_busy, 3) if c.loop_busy is not None else None,
            "machine_busy": round(c.machine_busy, 3) if c.machine_busy is not None else None,
            "cpu_ms_workers": (round(c.workers_cpu_ms_per_request, 3)
                               if c.workers_cpu_ms_per_request is not None else None),
            "errors": c.errors,
        }
    return row


HEADER = (f"{'workload':<8} {'mode':<6} {'c':>3} | {'direct':>7} | {'floor':>7} {'/dir':>5} "
          f"{'cpu ms':>6} {'+p50':>6} {'+p99':>6} | {'kvgate':>7} {'/dir':>5} {'/floor':>6} "
          f"{'cpu ms':>6} {'+p50':>6} {'+p99':>6}")
BASELINE_HEADER = f" | {'baseline':>8} {'/floor':>6} {'cpu ms':>6} {'+p50':>6}"


def _print_row(row: dict[str, Any]) -> None:
    f, k, d = row["floor"], row["kvgate"], row["direct"]
    errors = sum(row[t]["errors"] for t in (*TARGETS, BASELINE) if t in row)
    b = row.get(BASELINE)
    base = (f" | {b['rps']:>8,.0f} {b['vs_floor']:>6.2f} {b['cpu_ms_per_request']:>6.2f} "
            f"{b['added_p50_ms']:>6.2f}" if b else "")
    print(f"{row['workload']:<8} {'stream' if row['stream'] else 'json':<6} "
          f"{row['concurrency']:>3} | {d['rps']:>7,.0f} | {f['rps']:>7,.0f} "
          f"{f['vs_direct']:>5.2f} {f['cpu_ms_per_request']:>6.2f} {f['added_p50_ms']:>6.2f} "
          f"{f['added_p99_ms']:>6.2f} | {k['rps']:>7,.0f} {k['vs_direct']:>5.2f} "
          f"{k['vs_floor']:>6.2f} {k['cpu_ms_per_request']:>6.2f} {k['added_p50_ms']:>6.2f} "
          f"{k['added_p99_ms']:>6.2f}" + base + _workers_note(row)
          + (f"  ERRORS {errors}" if errors else ""), flush=True)


def _workers_note(row: dict[str, Any]) -> str:
    """Where a kvgate's CPU went, when it has count workers: its event loop's process
    and the workers (the `cpu ms` columns are the sum)."""
    notes = []
    for t in ("kvgate", BASELINE):
        c = row.get(t)
        if c and c.get("cpu_ms_workers"):
            notes.append(f"{t}: loop {c['cpu_ms_per_request'] - c['cpu_ms_workers']:.2f} "
                         f"+ workers {c['cpu_ms_workers']:.2f}")
        if c and c.get("loop_busy") is not None and t == "kvgate":
            notes.append(f"{t} loop process {c['loop_busy']:.0%} busy, machine "
                         f"{c['machine_busy']:.0%}")
    return ("  [" + "; ".join(notes) + "]") if notes else ""


def median_rows(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per cell and target, the median of every figure over the runs."""
    out = []
    for cells in zip(*runs, strict=True):
        row = dict(cells[0])
        for target in (*TARGETS, BASELINE):
            if target not in row:
                continue
            row[target] = {key: (statistics.median(c[target][key] for c in cells)
                                 if isinstance(row[target][key], int | float) else
                                 row[target][key])
                           for key in row[target]}
        out.append(row)
    return out


def kvgate_config(tmp: Path, port: int, upstream: str, count_workers: int = 0,
                  prefix_sharing: str | None = None, llama_slots: int = 0,
                  vllm_dir: Path | None = None) -> Path:
    tmp.mkdir(exist_ok=True)
    config = tmp / "kvgate.toml"
    server: dict[str, object] = {"listen": f"127.0.0.1:{port}"}
    if count_workers:  # written only when set: an older --baseline checkout lacks the key
        server["count_workers"] = count_workers
    extra: dict[str, Any] = {} if prefix_sharing is None else {"prefix_sharing": prefix_sharing}
    backend: dict[str, Any] = {"name": "mock", "url": upstream}
    model: dict[str, Any] = {"max_model_len": 40960, "reservation": "adaptive",
                             "deployment": {"kv_tokens": 100_000_000}}
    if llama_slots:  # one llama-server: strict (adaptive is refused there), its slots
        backend = {"name": "llama", "url": upstream, "kind": "llama.cpp",
                   "slots": llama_slots}
        model = {"max_model_len": LLAMA_CTX, "reservation": "strict",
                 "deployment": {"kv_tokens": LLAMA_CTX, "block_size": 1},
                 "prefix_sharing": "off"}
    name, path = MODEL, MODEL_DIR
    if vllm_dir is not None:  # one vLLM CPU server: its served name, pool and block size
        backend = {"name": "vllm", "url": upstream, "kind": "vllm"}
        model = {"max_model_len": VLLM_MAX_LEN, "reservation": "adaptive",
                 "deployment": {"kv_tokens": (VLLM_BLOCKS - 1) * VLLM_BLOCK,
                                "block_size": VLLM_BLOCK},
                 "prefix_sharing": "off"}
        name, path = VLLM_NAME, vllm_dir
    config.write_text(tomli_w.dumps({
        "server": server,
        "queue": {"max_depth": 4096},
        # The mode is written, not left to the default: both kvgates run the same mode.
        "models": [{"name": name, "path": str(path), **model,
                    "backends": [backend], **extra}],
    }))
    return config


LLAMA_CTX, LLAMA_SLOTS = 8192, 4  # --engine llama.cpp: ~1,100-token requests, 4 at once
# --engine vllm: a 9,216-token pool (289 blocks of 32, one vLLM's null block) holds 8
# ~1,100-token requests at once; prefix caching off, as for llama.cpp's slots
VLLM_BLOCKS, VLLM_BLOCK, VLLM_MAX_LEN, VLLM_SEQS = 289, 32, 2048, 16
VLLM_NAME = "tiny-qwen3"  # the name vLLM serves the tiny Qwen3 as


@contextlib.contextmanager
def direct_target(args: argparse.Namespace, me: list[str], port: int, tmp: Path,
                  urls: dict[str, str]) -> Iterator[Any]:
    """What `direct` is: the mock on `port`, or (`--engine llama.cpp`) a llama-server
    on a port of its own; `urls["direct"]` is set to it. Yields what has a `.pid`."""
    if not args.engine:
        with process([*me, "--role", "mock", "--port", str(port)], port, "mock") as mock:
            yield mock
        return
    if args.engine == "vllm":
        from tests.support.engines import start_vllm

        # vLLM checks the served name; greedy, so every answer is the same work each time
        EXTRA_BODY.update({"model": VLLM_NAME, "temperature": 0})
        vllm = start_vllm(tmp, num_blocks=VLLM_BLOCKS, block_size=VLLM_BLOCK,
                          max_model_len=VLLM_MAX_LEN, max_num_seqs=VLLM_SEQS)
        urls["direct"] = vllm.url
        try:
            yield vllm.proc
        finally:
            vllm.stop()
        return
    from benchmarks.suite.llamacpp import LLAMA_BODY
    from tests.support.engines import start_llama_server

    EXTRA_BODY.update({k: v for k, v in LLAMA_BODY.items() if k != "model"})
    engine = start_llama_server(tmp, ctx_size=LLAMA_CTX, parallel=LLAMA_SLOTS)
    urls["direct"] = engine.url
    try:
        yield engine.proc
    finally:
        engine.stop()


def _tiny_dir() -> Path:
    from tests.support.engines import tiny_model_dir

    return tiny_model_dir()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["mock", "floor"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", default="", help=argparse.SUPPRESS)
    parser.add_argument("--upstream-close", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=600,
                        help="requests per target per cell (a quarter at concurrency 1)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--workloads", nargs="+", default=["unique", "shared"],
                        choices=["unique", "shared"])
    parser.add_argument("--modes", nargs="+", default=["json", "stream"],
                        choices=["json", "stream"], help="answers as one body, as events")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--kvgate-env", nargs="*", default=[], metavar="NAME=VALUE",
                        help="environment for kvgate and the --baseline kvgate alike, "
                             "e.g. KVGATE_LOOP=asyncio KVGATE_FAST_BPE=0")
    parser.add_argument("--baseline", type=Path, metavar="DIR",
                        help="also run kvgate from this checkout (e.g. `git archive` of main)")
    parser.add_argument("--count-workers", type=int, default=0, metavar="N",
                        help="kvgate (not --baseline) counts in N worker processes")
    parser.add_argument("--prefix-sharing", choices=["auto", "off"],
                        help="kvgate's (not --baseline's) prefix_sharing; default: the "
                             "config's default (auto: block keys for every prompt)")
    parser.add_argument("--engine", choices=["llama.cpp", "vllm"],
                        help="`direct` is a real engine instead of the mock: one llama-server "
                             "(the tiny Qwen3, 4 slots, one unified pool), kvgate in front "
                             "with kind llama.cpp, strict; or one vLLM CPU server (the tiny "
                             "Qwen3, dummy weights, a 9,216-token pool), kvgate in front "
                             "with kind vllm, adaptive; not with --baseline")
    parser.add_argument("--repeat", type=int, default=1, metavar="K",
                        help="run every cell K times; print each run, then the medians")
    parser.add_argument("--profile", type=Path,
                        help="record kvgate with py-spy into this file (svg, or .txt: raw)")
    parser.add_argument("--profile-baseline", action="store_true",
                        help="profile the --baseline kvgate instead of this one")
    args = parser.parse_args()
    if args.role:
        serve_role(args.role, args.port, args.upstream, args.upstream_close)
        return
    if args.engine and args.baseline:
        parser.error("--engine runs without --baseline")
    mock_port, floor_port, kv_port, base_port = free_port(), free_port(), free_port(), free_port()
    urls = {t: f"http://127.0.0.1:{p}" for t, p in
            (("direct", mock_port), ("floor", floor_port), ("kvgate", kv_port))}
    if args.baseline:
        urls[BASELINE] = f"http://127.0.0.1:{base_port}"
    # The mock and the floor run as this module from ROOT (cwd), so they import this
    # checkout's `benchmarks` and `proxy` like the client does.
    me = ["-m", "benchmarks.bench_peers"]
    kvgate_env = dict(item.split("=", 1) for item in args.kvgate_env)
    with tempfile.TemporaryDirectory() as tmp, \
            direct_target(args, me, mock_port, Path(tmp), urls) as mock, \
            process([*me, "--role", "floor", "--port", str(floor_port), "--upstream",
                     urls["direct"], *(["--upstream-close"] if args.engine else [])],
                    floor_port, "floor") as floor, \
            process(["-m", "proxy", "serve", "--config",
                     str(kvgate_config(Path(tmp), kv_port, urls["direct"],
                                       args.count_workers, args.prefix_sharing,
                                       LLAMA_SLOTS if args.engine == "llama.cpp" else 0,
                                       _tiny_dir() if args.engine == "vllm" else None))],
                    kv_port,
                    "kvgate", env=kvgate_env) as kv:
        pids: dict[str, int | None] = {"direct": mock.pid, "floor": floor.pid, "kvgate": kv.pid}
        baseline = contextlib.ExitStack()
        if args.baseline:
            base = baseline.enter_context(process(
                ["-m", "proxy", "serve", "--config",
                 str(kvgate_config(Path(tmp) / "base", base_port, urls["direct"]))],
                base_port, "baseline kvgate", env=kvgate_env, cwd=args.baseline.resolve()))
            pids[BASELINE] = base.pid
        spy = None
        if args.profile:
            exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
            fmt = "raw" if args.profile.suffix == ".txt" else "flamegraph"
            spied = pids[BASELINE] if args.profile_baseline else kv.pid
            spy = subprocess.Popen([exe, "record", "--pid", str(spied), "--threads",
                                    "--format", fmt, "-o", str(args.profile), "--rate", "250"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"{args.requests} requests per target per cell in {args.rounds} interleaved "
              f"rounds; max_tokens {args.max_tokens}; proxy CPU from /proc; +p50/+p99 over "
              "direct in ms")
        print(HEADER + (BASELINE_HEADER if args.baseline else ""))
        try:
            with asyncio.Runner(loop_factory=new_loop) as runner:
                runs = [runner.run(run_all(urls, pids, args, k)) for k in range(args.repeat)]
            rows = runs[0]
            if args.repeat > 1:
                rows = median_rows(runs)
                print(f"median of {args.repeat} runs")
                print(HEADER + (BASELINE_HEADER if args.baseline else ""))
                for row in rows:
                    _print_row(row)
        finally:
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(timeout=60)
            baseline.close()
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
