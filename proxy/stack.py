"""`kvgate local-stack`: the compose stack as plain processes on loopback.

Redis, two simulated GPU backends, two kvgate replicas sharing the Redis ledger, and
nginx in front (proxy/bundled/nginx-local.conf.template), for machines without a container
engine. Ports from --base-port B: load balancer B, replicas B+1 and B+2, simulated
backends B+3 and B+4, Redis B+5. Everything stops together on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import tomli_w

from proxy.bundled import bundled_file, bundled_model_dir

__all__ = ["run_local_stack", "spawn_logged", "stop_process", "wait_port"]

# The folder `proxy` is imported from (a checkout or site-packages): children started
# with `python -m proxy` there import this same kvgate.
ROOT = Path(__file__).resolve().parent.parent


def spawn_logged(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """Start a process in its own session (so its group can be stopped), output to `log`."""
    with log.open("wb") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)


def stop_process(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _log_tail(log: Path, lines: int = 20) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    tail = "\n".join(text.splitlines()[-lines:])
    return f"; last lines of {log}:\n{tail}" if tail else ""


def _exited(name: str, proc: subprocess.Popen[bytes], log: Path | None = None) -> RuntimeError:
    """Why a child is gone, with the end of its log: the status alone (2 is any
    OSError, a port taken among them) tells an operator nothing."""
    tail = _log_tail(log) if log is not None else ""
    return RuntimeError(f"{name} exited with status {proc.returncode}{tail}")


def wait_port(port: int, proc: subprocess.Popen[bytes], name: str, timeout_s: float = 30,
              log: Path | None = None) -> None:
    """Until the child accepts on `port`. A connection whose two ends are the same
    address is the kernel connecting the probe to itself (TCP simultaneous open, when
    the probe's ephemeral port happens to be `port`), not the child listening."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise _exited(name, proc, log)
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
                if sock.getsockname() != sock.getpeername():
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{name} did not open port {port} within {timeout_s:.0f} s")


def _replica_config(port: int, redis_port: int, sims: list[int], kv_tokens: int,
                    model_dir: Path | None = None) -> str:
    """One replica's config, built as data and written by a TOML writer (any path is
    quoted right, backslashes and quotes included)."""
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "health_interval_s": 1.0},
        "queue": {"max_depth": 64, "default_deadline_s": 10.0},
        "ledger": {"kind": "redis", "url": f"redis://127.0.0.1:{redis_port}/0",
                   "lease_ttl_s": 10.0, "key_prefix": "kvgate-local"},
        "models": [{
            "name": "qwen3-14b",
            "path": str(model_dir or bundled_model_dir()),
            "max_model_len": 8192,
            "deployment": {"kv_tokens": kv_tokens, "block_size": 16},
            "backends": [{"name": f"sim-{chr(97 + i)}", "url": f"http://127.0.0.1:{p}"}
                         for i, p in enumerate(sims)],
        }],
    }
    return tomli_w.dumps(config)


def run_local_stack(*, base_port: int, workdir: Path, kv_tokens: int,
                    decode_step_ms: float) -> None:
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists()
                                      else None)
    redis_server = shutil.which("redis-server")
    if nginx is None or redis_server is None:
        raise RuntimeError("local-stack needs nginx and redis-server (scripts/setup.sh "
                           "installs both)")
    workdir.mkdir(parents=True, exist_ok=True)
    lb, r1, r2, s1, s2, redis_port = (base_port + i for i in range(6))
    procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def spawn(name: str, args: list[str], port: int) -> None:
        log = workdir / f"{name}.log"
        proc = spawn_logged(args, log)
        procs.append((name, proc))
        wait_port(port, proc, name, log=log)

    kvgate = [sys.executable, "-m", "proxy"]
    try:
        spawn("redis", [redis_server, "--port", str(redis_port), "--bind", "127.0.0.1",
                        "--save", "", "--appendonly", "no", "--dir", str(workdir)], redis_port)
        for name, port in (("sim-a", s1), ("sim-b", s2)):
            spawn(name, [*kvgate, "sim", "--port", str(port), "--kv-tokens", str(kv_tokens),
                         "--model", "qwen3-14b", "--model-dir", str(bundled_model_dir()),
                         "--max-model-len", "8192", "--decode-step-ms", str(decode_step_ms)],
                  port)
        for name, port in (("kvgate-1", r1), ("kvgate-2", r2)):
            config = workdir / f"{name}.toml"
            config.write_text(_replica_config(port, redis_port, [s1, s2], kv_tokens))
            spawn(name, [*kvgate, "serve", "--config", str(config)], port)
        template = bundled_file("nginx-local.conf.template").read_text()
        nginx_conf = workdir / "nginx.conf"
        nginx_conf.write_text(template.replace("@PREFIX@", str(workdir))
                              .replace("@LB_PORT@", str(lb))
                              .replace("@R1@", str(r1)).replace("@R2@", str(r2)))
        spawn("nginx", [nginx, "-p", str(workdir), "-c", str(nginx_conf)], lb)
        print(f"kvgate local stack: load balancer http://127.0.0.1:{lb}", flush=True)
        print(f"  replicas :{r1} :{r2}, simulated backends :{s1} :{s2}, redis :{redis_port}; "
              f"logs in {workdir}", flush=True)
        stop = False

        def on_signal(_sig: int, _frame: object) -> None:
            nonlocal stop
            stop = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        while not stop:
            for name, proc in procs:
                if proc.poll() is not None:
                    raise _exited(name, proc, workdir / f"{name}.log")
            time.sleep(0.2)
    finally:
        for _name, proc in reversed(procs):
            stop_process(proc)
