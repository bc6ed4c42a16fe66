"""kvgate processes (sim, serve) on loopback, for tests that need real separate replicas."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import tomli_w

from proxy.stack import spawn_logged, stop_process, wait_port
from tests.support.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
QWEN = ROOT / "models" / "qwen3-14b"


class Proc:
    def __init__(self, args: list[str], port: int, log: Path) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.proc = spawn_logged([sys.executable, "-m", "proxy", *args], log)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        wait_port(self.port, self.proc, self.url, timeout_s)

    def kill(self, sig: int = signal.SIGTERM) -> None:
        stop_process(self.proc, sig)


def start_sim(tmp: Path, *, kv_tokens: int, decode_step_ms: float, name: str,
              output_len: str = "max") -> Proc:
    port = free_port()
    return Proc(["sim", "--port", str(port), "--kv-tokens", str(kv_tokens),
                 "--model", "qwen3-14b", "--model-dir", str(QWEN), "--output-len", output_len,
                 "--decode-step-ms", str(decode_step_ms), "--max-model-len", "8192"],
                port, tmp / f"{name}.log")


def start_proxy(tmp: Path, *, name: str, redis_url: str, sims: list[Proc], kv_tokens: int,
                ttl_s: float = 2.0, queue: dict[str, Any] | None = None,
                reservation: str = "strict", adaptive: dict[str, Any] | None = None,
                only: list[int] | None = None, prefix_mirror_s: float | None = None) -> Proc:
    """A `kvgate serve` process on the shared Redis ledger; the config is written as data.
    Backend i is `gpu-i` in front of `sims[i]` (`only`: just those indices)."""
    port = free_port()
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "health_interval_s": 0.5},
        "queue": {"max_depth": 32, "default_deadline_s": 3.0, **(queue or {})},
        "ledger": {"kind": "redis", "url": redis_url, "lease_ttl_s": ttl_s,
                   "refresh_interval_s": 0.2, "key_prefix": "kvgate-test",
                   **({} if prefix_mirror_s is None
                      else {"prefix_mirror_interval_s": prefix_mirror_s})},
        "models": [{
            "name": "qwen3-14b", "path": str(QWEN), "max_model_len": 8192,
            "reservation": reservation,
            **({"adaptive": adaptive} if adaptive else {}),
            "deployment": {"kv_tokens": kv_tokens, "block_size": 16},
            "backends": [{"name": f"gpu-{i}", "url": s.url} for i, s in enumerate(sims)
                         if only is None or i in only],
        }],
    }
    path = tmp / f"{name}.toml"
    path.write_text(tomli_w.dumps(config))
    return Proc(["serve", "--config", str(path)], port, tmp / f"{name}.log")
