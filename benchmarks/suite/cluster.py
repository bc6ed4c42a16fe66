"""Two simulated GPU backends, with or without kvgate in front, as separate processes."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from benchmarks.suite.loadgen import Sample
from proxy.stack import spawn_logged, stop_process, wait_port

ROOT = Path(__file__).resolve().parents[2]
QWEN = ROOT / "models" / "qwen3-14b"


@dataclass(frozen=True, slots=True, kw_only=True)
class SimParams:
    kv_tokens: int = 16384
    decode_step_ms: float = 20.0
    per_seq_ms: float = 0.2
    prefill_tokens_per_s: float = 40000.0
    max_model_len: int = 8192

    def step_s(self, running: float) -> float:
        return (self.decode_step_ms + self.per_seq_ms * running) / 1000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Cluster:
    sims: list[str]
    proxy: str | None
    capacity: int
    samples: list[Sample] = field(default_factory=list)

    @property
    def targets(self) -> list[str]:
        return [self.proxy] if self.proxy else self.sims

    async def sample(self, t: float) -> None:
        """One point of resident tokens (real and reserved) and queue depth."""
        timeout = aiohttp.ClientTimeout(total=1.0)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            resident = waiting = 0
            for url in self.sims:
                async with s.get(f"{url}/sim/state") as resp:
                    st = await resp.json()
                resident += st["blocks_used"] * st["block_size"]
                waiting += st["waiting"]
            reserved = None
            if self.proxy:
                async with s.get(f"{self.proxy}/admin/state") as resp:
                    model = (await resp.json())["models"]["qwen3-14b"]
                reserved = sum(b["resident_tokens"] for b in model["backends"].values())
                waiting = model["queue_depth"]
        self.samples.append(Sample(t=t, resident=resident, reserved=reserved,
                                   capacity=self.capacity, queued=waiting))

    async def preemptions(self) -> int:
        async with aiohttp.ClientSession() as s:
            total = 0
            for url in self.sims:
                async with s.get(f"{url}/sim/state") as resp:
                    total += int((await resp.json())["preemptions"])
            return total


@contextlib.contextmanager
def cluster(params: SimParams, *, proxy: bool, ordering: str = "fifo",
            deadline_s: float = 10.0, max_depth: int = 256,
            ledger_url: str | None = None, seed: int = 0) -> Iterator[Cluster]:
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as tmp:
        try:
            sims = []
            for i in range(2):
                port = free_port()
                proc = spawn_logged(
                    [sys.executable, "-m", "proxy", "sim", "--port", str(port),
                     "--kv-tokens", str(params.kv_tokens), "--model", "qwen3-14b",
                     "--model-dir", str(QWEN), "--output-len", "max",
                     "--decode-step-ms", str(params.decode_step_ms),
                     "--per-seq-ms", str(params.per_seq_ms),
                     "--prefill-tokens-per-s", str(params.prefill_tokens_per_s),
                     "--max-model-len", str(params.max_model_len), "--seed", str(seed + i)],
                    Path(tmp) / f"sim{i}.log")
                procs.append(proc)
                wait_port(port, proc, f"sim {i}")
                sims.append(f"http://127.0.0.1:{port}")
            proxy_url = None
            if proxy:
                port = free_port()
                ledger = (f'[ledger]\nkind = "redis"\nurl = "{ledger_url}"\n'
                          if ledger_url else "")
                backends = "".join(f'\n[[models.backends]]\nname = "sim-{i}"\nurl = "{u}"\n'
                                   for i, u in enumerate(sims))
                config = Path(tmp) / "kvgate.toml"
                config.write_text(f"""[server]
listen = "127.0.0.1:{port}"
[queue]
max_depth = {max_depth}
default_deadline_s = {deadline_s}
ordering = "{ordering}"
starvation_s = 5.0
{ledger}
[[models]]
name = "qwen3-14b"
path = "{QWEN}"
max_model_len = {params.max_model_len}
[models.deployment]
kv_tokens = {params.kv_tokens}
block_size = 16
{backends}""")
                proc = spawn_logged([sys.executable, "-m", "proxy", "serve", "--config",
                                     str(config)], Path(tmp) / "kvgate.log")
                procs.append(proc)
                wait_port(port, proc, "kvgate")
                proxy_url = f"http://127.0.0.1:{port}"
            yield Cluster(sims=sims, proxy=proxy_url, capacity=2 * params.kv_tokens)
        finally:
            for proc in reversed(procs):
                stop_process(proc)
