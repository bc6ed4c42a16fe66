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
import subprocess
import sys
import tempfile
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
from benchmarks.suite.engine_run import Probe, RealEngine, measure_streams
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

    @property
    def kv_tokens(self) -> int:
        return self.ctx_size

    @property
    def max_num_seqs(self) -> int:
        return self.parallel


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


def probe(params: LlamaParams, *, prompt_tokens: int, concurrency: Sequence[int] = (1, 3),
          output_tokens: int = 160, backends: int = 2) -> Probe:
    """Both servers at once, `n` streams each for each n in `concurrency` (see
    `engine_run.measure_streams`). Bounded: a few requests, 120 s."""
    with llama_cluster(params, backends=backends) as c:
        return asyncio.run(measure_streams(
            c.servers, LLAMA_BODY, prompt_tokens=prompt_tokens, concurrency=concurrency,
            output_tokens=output_tokens, fresh_connections=True))


def llama_engine(params: LlamaParams) -> RealEngine:
    """llama-servers of `params` as a `RealEngine` for `engine_run.run_target`."""
    return RealEngine(
        name="llama.cpp", what="llama-server", body=LLAMA_BODY,
        cluster=lambda gate, backends: llama_cluster(params, gate=gate, backends=backends))


def llama_header(llama: LlamaParams, measured: Probe, sim: SimParams, version: str) -> str:
    steps = ", ".join(f"{n} stream{'s' if n > 1 else ''} each: {ms:.2f} ms"
                      for n, ms in sorted(measured.step_ms.items()))
    return (
        f"Engine: 2 llama.cpp `llama-server`s ({version}), the tiny random-weight Qwen3 "
        f"(real Qwen3 tokenizer and chat template), each `--ctx-size {llama.ctx_size} "
        f"--parallel {llama.parallel} --kv-unified --threads {llama.threads}`: one "
        f"{llama.ctx_size:,}-token KV pool per server shared by {llama.parallel} slots. "
        "kvgate in front: `kind = \"llama.cpp\"`, `slots = "
        f"{llama.parallel}`, `kv_tokens = max_model_len = {llama.ctx_size}`, `block_size = "
        "1`, `prefix_sharing = \"off\"`; the `adaptive` target is written as "
        "`reservation = \"adaptive\"` as it is for the simulator.\n\n"
        f"Measured before the runs, both servers at once ({measured.prompt_tokens}-word "
        f"prompts, {measured.output_tokens} tokens, {measured.wall_s:.0f} s): time per "
        f"token of one stream with {steps}; prefill about "
        f"{measured.prefill_tokens_per_s:,.0f} tokens/s (first token of the single streams). "
        f"The simulator twin is fitted to that: {sim.kv_tokens:,} KV tokens and at most "
        f"{sim.max_num_seqs} running sequences per backend, decode step "
        f"{sim.decode_step_ms} ms + {sim.per_seq_ms} ms per running sequence, prefill "
        f"{sim.prefill_tokens_per_s:,.0f} tokens/s, max_model_len {sim.max_model_len:,}, "
        "no prefix caching. Loads are calibrated as for the simulator (Little's law at the "
        "recorded lengths on the fitted step time), so 1x is the same rate for both.\n\n"
        "What differs from the simulator's runs: (1) the model never samples EOS, so each "
        "client closes its stream once it has read the request's recorded output length in "
        "content chunks (the model's end played by the client; llama-server stops the "
        "request when the connection goes, kvgate releases its lease on the disconnect); "
        "no body carries that length, neither as `max_tokens` nor as `sim_output_tokens` "
        "(the simulator's runs send `sim_output_tokens`, which only the simulator reads); "
        "a llama-server chunk can hold more than one token, so an answer may run a few "
        "tokens past its recorded length before the client hangs up; (2) bodies to "
        "llama-server carry `\"cache_prompt\": false`, `\"temperature\": 0` (greedy: the "
        "random model then never picks its end-of-generation token; sampled, it does now "
        "and then) and the model name `tiny-qwen3`; "
        "(3) llama.cpp preempts nothing: when a server's pool overflows its running "
        "requests fail (an error status, an error event mid-stream, or an answer that "
        "ends short of its length: all counted as engine failures), where the simulator "
        "preempts and recomputes as vLLM does; (4) llama-server reports no KV use, so the "
        "KV figures compared are the clients' view (prompt + tokens streamed so far over "
        "the open streams, as a share of both pools), taken the same way on both; "
        "(5) llama-server computes on the same 2 CPU cores as the clients, kvgate and "
        "whatever else runs on the machine, the simulator only sleeps.")


__all__ = ["LLAMA_BODY", "LLAMA_MODEL", "MODEL", "LlamaCluster", "LlamaParams", "Probe",
           "kvgate_llama_config", "llama_cluster", "llama_engine", "llama_header",
           "parse_llama_metrics", "probe"]
