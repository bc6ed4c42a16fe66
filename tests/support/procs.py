"""kvgate processes (sim, serve) on loopback, for tests that need real separate replicas."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.support.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
QWEN = ROOT / "models" / "qwen3-14b"


class Proc:
    def __init__(self, args: list[str], port: int, log: Path) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._log = log.open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "proxy", *args], cwd=ROOT,
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"process exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"port {self.port} did not open")

    def kill(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=10)
        self._log.close()


def start_sim(tmp: Path, *, kv_tokens: int, decode_step_ms: float, name: str) -> Proc:
    port = free_port()
    return Proc(["sim", "--port", str(port), "--kv-tokens", str(kv_tokens),
                 "--model", "qwen3-14b", "--model-dir", str(QWEN), "--output-len", "max",
                 "--decode-step-ms", str(decode_step_ms), "--max-model-len", "8192"],
                port, tmp / f"{name}.log")


def start_proxy(tmp: Path, *, name: str, redis_url: str, sims: list[Proc], kv_tokens: int,
                ttl_s: float = 2.0, queue: str = "") -> Proc:
    port = free_port()
    backends = "".join(
        f'\n[[models.backends]]\nname = "gpu-{i}"\nurl = "{s.url}"\n' for i, s in enumerate(sims)
    )
    config = tmp / f"{name}.toml"
    config.write_text(f"""
[server]
listen = "127.0.0.1:{port}"
health_interval_s = 0.5

[queue]
max_depth = 32
default_deadline_s = 3.0
{queue}

[ledger]
kind = "redis"
url = "{redis_url}"
lease_ttl_s = {ttl_s}
refresh_interval_s = 0.2
key_prefix = "kvgate-test"

[[models]]
name = "qwen3-14b"
path = "{QWEN}"
max_model_len = 8192

[models.deployment]
kv_tokens = {kv_tokens}
block_size = 16
{backends}""")
    return Proc(["serve", "--config", str(config)], port, tmp / f"{name}.log")
