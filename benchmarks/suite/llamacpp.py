"""llama.cpp's `llama-server` as the suite's backends, in place of the simulator.

Two llama-servers (the cached binary and tiny random-weight Qwen3 of
scripts/engines/, started by tests/support/engines.py) with small unified KV pools
(`--ctx-size` tokens shared by `--parallel` slots, `--kv-unified`), and kvgate in front
for the kvgate targets with `kind = "llama.cpp"`, `slots`, the pool as `kv_tokens` and
`max_model_len` (a unified pool lets one slot grow to all of it), `block_size` 1 (a
llama.cpp cell holds one token) and `prefix_sharing = "off"` (llama.cpp's slots keep
no shared prefix cache).

The model never samples EOS (its added tokens' embeddings are zero), so the clients end
each answer themselves at its recorded length (`hang_up_at_output` in loadgen): no
request ever carries that length, to kvgate or to the engine. Bodies carry
`cache_prompt: false` (the suite's prompts are one word repeated, which a slot's prompt
cache would reuse as real traffic never does) and `temperature: 0` (the model then never
ends an answer by itself).

What llama-server reports (`--metrics`): requests processing and deferred, tokens
predicted; no KV use. KV use here is the clients' view: prompt + tokens streamed so far
over the open streams (`loadgen.client_held`), the pool's share of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.suite.cluster import (
    MODEL,
    GateSettings,
    SimParams,
    StartFailed,
    _start,
    free_port,
    to_toml,
)
from benchmarks.suite.loadgen import Result, Sample, client_held
from proxy.stack import stop_process

LLAMA_MODEL = "tiny-qwen3"  # the alias tests/support/engines.py serves the model as


@dataclass(frozen=True, slots=True, kw_only=True)
class LlamaParams:
    ctx_size: int = 4096  # one unified pool per server, in tokens (cells)
    parallel: int = 4  # slots: requests one server runs at once
    threads: int = 1  # per server (docs/real-engines.md: 2 is ten times slower here)

    @property
    def max_model_len(self) -> int:
        return self.ctx_size  # unified: one slot may hold the whole pool


# The fields every body sends to llama-server: its served name, no prompt cache reuse,
# greedy decoding (sampled at llama-server's default temperature 0.8, the random model
# does pick its end-of-generation token now and then; at 0 it never does).
LLAMA_BODY: dict[str, Any] = {"model": LLAMA_MODEL, "cache_prompt": False,
                              "temperature": 0}


def kvgate_llama_config(params: LlamaParams, gate: GateSettings, *, port: int,
                        servers: list[str], model_dir: Path) -> dict[str, Any]:
    """kvgate's configuration in front of the llama-servers `servers`."""
    model: dict[str, Any] = {
        "name": LLAMA_MODEL, "path": str(model_dir), "max_model_len": params.max_model_len,
        "output_policy": gate.output_policy, "reservation": gate.reservation,
        "prefix_sharing": "off",
        "deployment": {"kv_tokens": params.ctx_size, "block_size": 1},
        "backends": [{"name": f"llama-{i}", "url": u, "kind": "llama.cpp",
                      "slots": params.parallel} for i, u in enumerate(servers)],
    }
    return {
        "server": {"listen": f"127.0.0.1:{port}"},
        "queue": {"max_depth": gate.max_depth, "default_deadline_s": gate.deadline_s,
                  "ordering": gate.ordering, "starvation_s": gate.starvation_s},
        "models": [model],
    }


_METRIC = re.compile(r"^(llamacpp:[a-z_]+) (\S+)$", re.MULTILINE)


def parse_llama_metrics(text: str) -> dict[str, float]:
    """llama-server's gauges and counters by name from its /metrics page."""
    return {m.group(1): float(m.group(2)) for m in _METRIC.finditer(text)}


@dataclass
class LlamaCluster:
    """The same face as `cluster.Cluster` for run_target: targets, sample, engine_totals."""

    servers: list[str]
    proxy: str | None
    capacity: int
    samples: list[Sample] = field(default_factory=list)
    results: list[Result] = field(default_factory=list)
    engines: list[Any] = field(default_factory=list)  # tests.support.engines.EngineProcess

    @property
    def sims(self) -> list[str]:
        return self.servers

    @property
    def targets(self) -> list[str]:
        return [self.proxy] if self.proxy else self.servers

    def watch(self, results: list[Result]) -> None:
        self.results = results

    async def engine_totals(self) -> dict[str, float]:
        """llama.cpp preempts nothing; its counters at the end, summed, and whether every
        server is still alive."""
        totals = {"preemptions": 0.0, "tokens_predicted": 0.0, "prompt_tokens": 0.0}
        async with aiohttp.ClientSession() as s:
            for url in self.servers:
                async with s.get(f"{url}/metrics") as resp:
                    m = parse_llama_metrics(await resp.text())
                totals["tokens_predicted"] += m.get("llamacpp:tokens_predicted_total", 0.0)
                totals["prompt_tokens"] += m.get("llamacpp:prompt_tokens_total", 0.0)
        totals["engines_alive"] = float(all(e.alive() for e in self.engines))
        return totals

    async def sample(self, t: float) -> None:
        timeout = aiohttp.ClientTimeout(total=1.0)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            running = waiting = 0
            for url in self.servers:
                async with s.get(f"{url}/metrics") as resp:
                    m = parse_llama_metrics(await resp.text())
                running += int(m.get("llamacpp:requests_processing", 0))
                waiting += int(m.get("llamacpp:requests_deferred", 0))
            reserved = queued = None
            if self.proxy:
                async with s.get(f"{self.proxy}/admin/state") as resp:
                    model = (await resp.json())["models"][LLAMA_MODEL]
                reserved = sum(b["resident_tokens"] for b in model["backends"].values())
                queued = int(model["queue_depth"])
        held = client_held(self.results)
        self.samples.append(Sample(
            t=t, kv_use=held / self.capacity, resident=held, reserved=reserved,
            capacity=self.capacity, queued=queued, engine_waiting=waiting, running=running,
            preemptions=0, client_held=held))


@contextlib.contextmanager
def llama_cluster(params: LlamaParams, *, gate: GateSettings | None = None,
                  backends: int = 2) -> Iterator[LlamaCluster]:
    """`backends` fresh llama-servers, and kvgate in front when `gate` is given."""
    from tests.support.engines import EngineUnavailable, start_llama_server, tiny_model_dir

    engines: list[Any] = []
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-llama-") as tmp:
        try:
            for _ in range(backends):
                try:
                    engines.append(start_llama_server(
                        Path(tmp), ctx_size=params.ctx_size, parallel=params.parallel,
                        unified=True,
                        extra=[] if params.threads == 1 else ["--threads", str(params.threads)]))
                except EngineUnavailable as exc:
                    raise StartFailed(f"llama-server: {str(exc)[-600:]}") from exc
            servers = [e.url for e in engines]
            proxy_url = None
            if gate is not None:
                port = free_port()
                config = Path(tmp) / "kvgate.toml"
                config.write_text(to_toml(kvgate_llama_config(
                    params, gate, port=port, servers=servers, model_dir=tiny_model_dir())))
                _start([sys.executable, "-m", "proxy", "serve", "--config", str(config)],
                       Path(tmp) / "kvgate.log", port, "kvgate", procs)
                proxy_url = f"http://127.0.0.1:{port}"
            yield LlamaCluster(servers=servers, proxy=proxy_url,
                               capacity=backends * params.ctx_size, engines=engines)
        finally:
            for proc in reversed(procs):
                stop_process(proc)
            for e in engines:
                e.stop()


@dataclass(frozen=True, slots=True)
class Probe:
    """What the two servers measured side by side, before the runs."""

    prompt_tokens: int
    output_tokens: int
    step_ms: dict[int, float]  # streams per server -> ms per token of one stream
    prefill_tokens_per_s: float
    wall_s: float

    def sim_params(self, params: LlamaParams) -> SimParams:
        """The simulator fitted to the probe: step = a + b x running, the same pools and
        slots (max_num_seqs), prefill at the measured rate, no prefix caching."""
        (n1, t1), (n2, t2) = sorted(self.step_ms.items())[:1] + sorted(self.step_ms.items())[-1:]
        per_seq = max(0.0, (t2 - t1) / (n2 - n1)) if n2 != n1 else 0.0
        base = max(0.1, t1 - per_seq * n1)
        return SimParams(kv_tokens=params.ctx_size, decode_step_ms=round(base, 3),
                         per_seq_ms=round(per_seq, 3),
                         prefill_tokens_per_s=round(self.prefill_tokens_per_s),
                         max_model_len=params.max_model_len, max_num_seqs=params.parallel)


async def _probe_stream(s: aiohttp.ClientSession, url: str, prompt_words: int,
                        output: int) -> tuple[float, float, int]:
    body = {**LLAMA_BODY, "messages": [{"role": "user", "content": " the" * prompt_words}],
            "max_tokens": output, "stream": True}
    start = time.perf_counter()
    first = None
    chunks = 0
    async with s.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise StartFailed(f"probe: llama-server answered {resp.status}")
        async for line in resp.content:
            if b'"delta":{"content":"' in line:
                chunks += 1
                if first is None:
                    first = time.perf_counter() - start
    end = time.perf_counter() - start
    return first or end, end, chunks


def probe(params: LlamaParams, *, prompt_tokens: int, concurrency: Sequence[int] = (1, 3),
          output_tokens: int = 160, backends: int = 2) -> Probe:
    """Both servers at once, `n` streams each for each n in `concurrency`: decode time per
    token of one stream at that load, and prefill rate from the single streams' first
    token. Bounded: a few requests, 120 s."""
    started = time.perf_counter()

    async def measure(urls: list[str]) -> Probe:
        steps: dict[int, float] = {}
        prefill: list[float] = []
        connector = aiohttp.TCPConnector(force_close=True)  # llama-server closes anyway
        async with aiohttp.ClientSession(connector=connector) as s, asyncio.timeout(120):
            await asyncio.gather(*(_probe_stream(s, u, 32, 8) for u in urls))  # warm up
            for n in concurrency:
                got = await asyncio.gather(*(_probe_stream(s, u, prompt_tokens, output_tokens)
                                             for u in urls for _ in range(n)))
                steps[n] = 1000 * statistics.median(
                    (end - first) / max(1, chunks - 1) for first, end, chunks in got)
                if n == min(concurrency):
                    prefill += [prompt_tokens / first for first, _, _ in got]
        return Probe(prompt_tokens=prompt_tokens, output_tokens=output_tokens, step_ms=steps,
                     prefill_tokens_per_s=statistics.median(prefill),
                     wall_s=time.perf_counter() - started)

    with llama_cluster(params, backends=backends) as c:
        return asyncio.run(measure(c.servers))


__all__ = ["LLAMA_BODY", "LLAMA_MODEL", "MODEL", "LlamaCluster", "LlamaParams", "Probe",
           "kvgate_llama_config", "llama_cluster", "parse_llama_metrics", "probe"]
