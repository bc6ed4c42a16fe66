"""kvgate as users install it: a wheel built from this checkout, installed into a fresh
venv outside it (dependencies from the package index, no system site-packages), run from
an unrelated directory with a clean environment. The checkout must not be needed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from proxy.stack import stop_process, wait_port
from tests.support.ports import free_port, free_port_range
from tests.support.reference import hf_count, hf_tokenizer

ROOT = Path(__file__).resolve().parent.parent
QWEN = ROOT / "models" / "qwen3-14b"
CHAT = {"model": "qwen3-14b", "max_tokens": 8,
        "messages": [{"role": "system", "content": "Answer briefly."},
                     {"role": "user", "content": "Is the wheel complete? Ünïcode too: 東京"}]}
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "proxy", "policies")


@dataclass(frozen=True)
class Installed:
    venv: Path
    wheel: Path
    home: Path

    def env(self) -> dict[str, str]:
        """What a user's shell would have: no PYTHONPATH, no checkout on any path."""
        return {"PATH": f"{self.venv / 'bin'}:/usr/local/bin:/usr/bin:/bin:/usr/sbin",
                "HOME": str(self.home),
                "LANG": "C.UTF-8"}

    def run(self, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.venv / "bin" / args[0]), *args[1:]], cwd=cwd,
                              env=self.env(), capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    tmp = tmp_path_factory.mktemp("packaging")
    # Build from a copy so the checkout gets no build/ or egg-info, and only what a
    # source tree ships is used.
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    dist = tmp / "dist"
    pip_env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    pip_env.pop("PYTHONPATH", None)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist),
                    str(src)], check=True, env=pip_env, timeout=300)
    (wheel,) = dist.glob("kvgate-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    # This interpreter's pip installs into the new venv; its packages stay invisible there.
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "-q", str(wheel)], check=True, env=pip_env, timeout=600)
    shutil.rmtree(src)
    home = tmp / "home"
    home.mkdir()
    return Installed(venv=venv, wheel=wheel, home=home)


@pytest.fixture(scope="module")
def expected_prompt_tokens() -> int:
    """Counted independently: transformers' apply_chat_template on the same files."""
    return hf_count(hf_tokenizer(QWEN), CHAT)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """An unrelated directory with nothing of kvgate in it."""
    assert not (tmp_path / "models").exists()
    return tmp_path


def _spawn(installed: Installed, args: list[str], cwd: Path) -> subprocess.Popen[bytes]:
    log = (cwd / "process.log").open("wb")
    try:
        return subprocess.Popen([str(installed.venv / "bin" / "kvgate"), *args], cwd=cwd,
                                env=installed.env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        log.close()


@pytest.fixture
def spawn(workdir: Path, installed: Installed) -> Iterator[Any]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(args: list[str], port: int) -> subprocess.Popen[bytes]:
        proc = _spawn(installed, args, workdir)
        procs.append(proc)
        try:
            wait_port(port, proc, f"kvgate {args[0]}", timeout_s=60)
        except RuntimeError as exc:
            raise AssertionError(f"{exc}\n{(workdir / 'process.log').read_text()}") from None
        return proc

    try:
        yield start
    finally:
        for proc in procs:
            stop_process(proc)


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], dict[str, Any]]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(request, timeout=20) as resp:
                return resp.status, dict(resp.headers), json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or time.monotonic() > deadline:  # 503: backends not yet up
                raise AssertionError(f"{exc.code}: {exc.read()!r}") from None
            time.sleep(0.2)


def test_wheel_installs_outside_the_checkout(installed: Installed, workdir: Path) -> None:
    where = installed.run("python", "-c", "import proxy, proxy.sim.server, proxy.bundled, "
                          "policies; print(proxy.__file__)", cwd=workdir)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(installed.venv)
    bundled = installed.run("python", "-m", "proxy.bundled", cwd=workdir)
    assert bundled.returncode == 0, bundled.stderr
    model_dir = Path(bundled.stdout.strip())
    assert model_dir.is_relative_to(installed.venv)
    assert {p.name for p in model_dir.iterdir()} >= {
        "tokenizer.json", "tokenizer_config.json", "config.json", "LICENSE", "NOTICE"}
    template = installed.run("python", "-c", "from proxy.bundled import bundled_file; "
                             "print(bundled_file('nginx-local.conf.template').read_text())",
                             cwd=workdir)
    assert "@LB_PORT@" in template.stdout, template.stderr


def test_installed_sim_counts_with_the_bundled_tokenizer_by_default(
    installed: Installed, workdir: Path, spawn: Any, expected_prompt_tokens: int
) -> None:
    port = free_port()
    spawn(["sim", "--port", str(port), "--kv-tokens", "4096", "--model", "qwen3-14b",
           "--max-model-len", "8192"], port)  # no --model-dir: the bundled one
    status, _headers, body = _post(f"http://127.0.0.1:{port}/v1/chat/completions", CHAT)
    assert status == 200
    assert body["usage"]["prompt_tokens"] == expected_prompt_tokens
    assert body["usage"]["completion_tokens"] <= 8
    assert body["choices"][0]["message"]["role"] == "assistant"


def test_installed_demo_answers_a_chat_completion_with_exact_counts(
    installed: Installed, workdir: Path, spawn: Any, expected_prompt_tokens: int
) -> None:
    port = free_port()
    spawn(["demo", "--port", str(port), "--kv-tokens", "4096"], port)
    status, headers, body = _post(f"http://127.0.0.1:{port}/v1/chat/completions", CHAT)
    assert status == 200
    assert body["usage"]["prompt_tokens"] == expected_prompt_tokens
    assert headers["x-kvgate-prompt-tokens"] == str(expected_prompt_tokens)
    # adaptive reservation (the default), cold start: the prompt + its first output token,
    # rounded up to 16-token blocks; the lease grows as the answer streams
    assert headers["x-kvgate-reserved-tokens"] == str(-(-(expected_prompt_tokens + 1) // 16) * 16)
    assert body["choices"][0]["finish_reason"] in ("length", "stop")


def test_installed_local_stack_serves_through_nginx(
    installed: Installed, workdir: Path, spawn: Any, expected_prompt_tokens: int
) -> None:
    """Redis, two sims, two replicas and nginx from the installed package (model and nginx
    template are package data), started from a directory with nothing of kvgate in it."""
    base = free_port_range(6)
    spawn(["local-stack", "--base-port", str(base), "--workdir", str(workdir / "stack"),
           "--kv-tokens", "2048", "--decode-step-ms", "1"], base)
    status, headers, body = _post(f"http://127.0.0.1:{base}/v1/chat/completions", CHAT)
    assert status == 200
    assert body["usage"]["prompt_tokens"] == expected_prompt_tokens
    assert headers["x-kvgate-prompt-tokens"] == str(expected_prompt_tokens)
    config = (workdir / "stack" / "kvgate-1.toml").read_text()
    assert str(installed.venv) in config and str(ROOT) not in config


def test_image_layout_sim_config_passes_check_config(installed: Installed, workdir: Path) -> None:
    """The Dockerfile's final stage as files: /app/deploy from the repo, /app/models/qwen3-14b
    linked to the installed package's bundled model (`python -m proxy.bundled`)."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ln -s "$(python -m proxy.bundled)" /app/models/qwen3-14b' in dockerfile
    app = workdir / "app"
    shutil.copytree(ROOT / "deploy", app / "deploy")
    (app / "models").mkdir()
    bundled = installed.run("python", "-m", "proxy.bundled", cwd=workdir).stdout.strip()
    (app / "models" / "qwen3-14b").symlink_to(bundled)
    check = installed.run("kvgate", "check-config", "--json", "app/deploy/kvgate-sim.toml",
                          cwd=workdir)
    assert check.returncode == 0, check.stderr
    report = json.loads(check.stdout)
    assert report["models"][0]["name"] == "qwen3-14b"
    assert [b["capacity_tokens"] for b in report["models"][0]["backends"]] == [16384, 16384]


def test_local_stack_replica_config_quotes_any_model_path(tmp_path: Path) -> None:
    """Written by a TOML writer: a path with quotes and backslashes stays one string."""
    import tomllib

    from proxy.config import parse_config
    from proxy.stack import _replica_config

    odd = tmp_path / 'we"ird\\dir'
    shutil.copytree(QWEN, odd)
    data = tomllib.loads(_replica_config(9001, 9002, [9003, 9004], 4096, model_dir=odd))
    assert data["models"][0]["path"] == str(odd)
    config = parse_config(data, base=tmp_path)
    assert [b.url for b in config.models[0].backends] == ["http://127.0.0.1:9003",
                                                           "http://127.0.0.1:9004"]
