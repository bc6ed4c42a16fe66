"""Real inference engines on 127.0.0.1 for the real-engine tests: llama.cpp's llama-server
and vLLM's CPU build, serving the tiny random-weight Qwen3 of
scripts/engines/tiny_qwen3_gguf.py.

What they need is built or installed by scripts/engines/*.sh into a cache outside the
repo (see docs/real-engines.md); these helpers run those scripts, which print the cached
paths at once when the cache is warm. A script that fails raises `EngineUnavailable`
with its output: the tests fail, they are never skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from proxy.stack import spawn_logged, stop_process
from tests.support.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts" / "engines"
TINY_MODEL = "tiny-qwen3"  # the name both engines serve and kvgate routes by


class EngineUnavailable(RuntimeError):
    """An engine could not be built, installed or started."""


def _script(args: list[str], what: str, timeout_s: float) -> Path:
    """Run a setup script; its last stdout line is the path it made."""
    try:
        done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise EngineUnavailable(f"{what}: {' '.join(args)} ran past {timeout_s:.0f} s") from exc
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise EngineUnavailable(
            f"{what}: {' '.join(args)} exited {done.returncode}\n{done.stderr[-4000:]}")
    path = Path(lines[-1])
    if not path.exists():
        raise EngineUnavailable(f"{what}: {' '.join(args)} printed {path}, which is missing")
    return path


@functools.cache
def llama_server_binary() -> Path:
    """The cached llama-server (built on first use: about 10 minutes on 2 cores)."""
    override = os.environ.get("KVGATE_LLAMA_SERVER")
    if override:
        return Path(override)
    return _script(["bash", str(SCRIPTS / "llama_server.sh")], "llama-server", 3600)


@functools.cache
def tiny_model_dir() -> Path:
    """config.json, the real Qwen3 tokenizer files and tiny-qwen3.gguf, in one directory."""
    override = os.environ.get("KVGATE_TINY_QWEN3")
    if override:
        return Path(override)
    gguf_py = llama_server_binary().parents[1] / "gguf-py"
    return _script([sys.executable, str(SCRIPTS / "tiny_qwen3_gguf.py"), "--gguf-py",
                    str(gguf_py)], "tiny Qwen3", 600)


@functools.cache
def vllm_python() -> Path:
    """The Python of the separate vLLM CPU venv (installed on first use)."""
    override = os.environ.get("KVGATE_VLLM_PYTHON")
    if override:
        return Path(override)
    return _script(["bash", str(SCRIPTS / "vllm_cpu.sh")], "vLLM CPU", 3600)


def _get(url: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # loopback only
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@dataclass
class EngineProcess:
    """A started engine: its base URL, process and log."""

    name: str
    url: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path
    started_s: float
    healthy_after_s: float | None = None

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_healthy(self, timeout_s: float) -> None:
        """Until GET /health answers 200; a process that exits or a timeout raises."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineUnavailable(f"{self.name} exited with status {self.proc.returncode}"
                                        f"\n{self.log_tail()}")
            try:
                status, _ = _get(f"{self.url}/health", 1.0)
                if status == 200:
                    self.healthy_after_s = time.monotonic() - self.started_s
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise EngineUnavailable(f"{self.name} not healthy within {timeout_s:.0f} s"
                                f"\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def metrics(self) -> str:
        status, body = _get(f"{self.url}/metrics", 5.0)
        if status != 200:
            raise AssertionError(f"{self.name} /metrics answered {status}: {body[:300]!r}")
        return body.decode()

    def stop(self) -> None:
        stop_process(self.proc)


def start_llama_server(log_dir: Path, *, ctx_size: int = 2048, parallel: int = 4,
                       unified: bool = True, extra: list[str] | None = None,
                       timeout_s: float = 60.0) -> EngineProcess:
    """llama-server on a free loopback port with the tiny Qwen3, healthy on return."""
    binary = llama_server_binary()
    model = tiny_model_dir()
    port = free_port()
    args = [str(binary), "-m", str(model / "tiny-qwen3.gguf"), "--alias", TINY_MODEL,
            "--host", "127.0.0.1", "--port", str(port), "--ctx-size", str(ctx_size),
            "-np", str(parallel), "--metrics", "--threads", "1", "--no-webui",
            *(["--kv-unified"] if unified else ["--no-kv-unified"]), *(extra or [])]
    log = log_dir / f"llama-server-{port}.log"
    engine = EngineProcess(name="llama-server", url=f"http://127.0.0.1:{port}", port=port,
                           proc=spawn_logged(args, log), log=log, started_s=time.monotonic())
    try:
        engine.wait_healthy(timeout_s)
    except BaseException:
        engine.stop()
        raise
    return engine


def start_vllm(log_dir: Path, *, num_blocks: int, block_size: int = 32,
               max_model_len: int = 4096, max_num_seqs: int = 16,
               timeout_s: float = 240.0, prefix_caching: bool = False) -> EngineProcess:
    """vLLM's OpenAI server (CPU build) with random (dummy) weights for the tiny Qwen3,
    healthy on return. `num_blocks` of `block_size` tokens (the CPU attention takes
    multiples of 32) are its whole KV pool; vLLM keeps one of them as its null block.
    Prefix caching is off unless asked, so that the same greedy request gives the same
    answer twice."""
    python = vllm_python()
    model = tiny_model_dir()
    port = free_port()
    args = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", TINY_MODEL, "--host", "127.0.0.1", "--port", str(port),
            "--load-format", "dummy", "--dtype", "bfloat16",
            "--max-model-len", str(max_model_len), "--block-size", str(block_size),
            "--num-gpu-blocks-override", str(num_blocks), "--max-num-seqs", str(max_num_seqs),
            "--max-num-batched-tokens", str(max(2048, max_model_len)),
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
            "--uvicorn-log-level", "warning",
            # tools with the default tool_choice "auto" need a parser (Qwen3's is hermes)
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    log = log_dir / f"vllm-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=log_dir,
                                env=env, start_new_session=True)
    engine = EngineProcess(name="vllm", url=f"http://127.0.0.1:{port}", port=port, proc=proc,
                           log=log, started_s=time.monotonic())
    try:
        engine.wait_healthy(timeout_s)
    except BaseException:
        engine.stop()
        raise
    return engine


@contextlib.asynccontextmanager
async def bounded(seconds: float) -> AsyncIterator[None]:
    """asyncio.timeout with a message that names the bound."""
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError as exc:
        raise AssertionError(f"the load loop ran past its {seconds:.0f} s bound") from exc


# ------------------------------------------------------------------------- answers


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The data of each server-sent event, in order ("[DONE]" included)."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.decode().splitlines():
                if line.startswith("data:"):
                    yield line[5:].strip()
    if buf.strip():
        for line in buf.decode().splitlines():
            if line.startswith("data:"):
                yield line[5:].strip()


def text_of(choice: dict[str, Any], chat: bool) -> str:
    if chat:
        return str(choice["message"].get("content") or "")
    return str(choice["text"])


async def answer(s: aiohttp.ClientSession, base: str, path: str, body: dict[str, Any]
                 ) -> dict[str, Any]:
    """status, headers, text, finish_reason, usage (streamed or not) of one request."""
    chat = path.endswith("chat/completions")
    async with s.post(f"{base}{path}", json=body) as resp:
        out: dict[str, Any] = {"status": resp.status, "headers": dict(resp.headers)}
        if not body.get("stream") or resp.status != 200:  # a refused stream is JSON
            data = await resp.json(content_type=None)
            out["json"] = data
            if resp.status == 200:
                choice = data["choices"][0]
                out |= {"text": text_of(choice, chat), "finish": choice["finish_reason"],
                        "usage": data.get("usage")}
            return out
        pieces: list[str] = []
        finish = None
        usage = None
        done = False
        errors: list[Any] = []
        async for data in sse_events(resp):
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            if "error" in event:
                errors.append(event["error"])
                continue
            for choice in event.get("choices") or []:
                piece = choice["delta"].get("content") if chat else choice.get("text")
                pieces.append(piece or "")
                finish = choice.get("finish_reason") or finish
            usage = event.get("usage") or usage
        out |= {"text": "".join(pieces), "finish": finish, "usage": usage, "done": done,
                "errors": errors}
        return out


# ------------------------------------------------------------------------- prompts


@functools.cache
def _tokenizer(model_dir: Path) -> Any:
    from tests.support.reference import hf_tokenizer

    return hf_tokenizer(model_dir)


def chat_of(model_dir: Path, tokens: int) -> list[dict[str, Any]]:
    """A one-message chat whose prompt is exactly `tokens` tokens with Qwen3's template."""
    from tests.support.reference import hf_count

    lo, hi = 1, tokens
    while lo <= hi:  # one more word, one more token
        n = (lo + hi) // 2
        messages = [{"role": "user", "content": "cache " * n}]
        got = hf_count(_tokenizer(model_dir), {"messages": messages})
        if got == tokens:
            return messages
        lo, hi = (n + 1, hi) if got < tokens else (lo, n - 1)
    raise AssertionError(f"no chat of {tokens} tokens")


def completion_of(model_dir: Path, tokens: int) -> str:
    """A completion prompt of exactly `tokens` tokens ("cache", then " cache"s)."""
    text = "cache" + " cache" * (tokens - 1)
    got = len(_tokenizer(model_dir).encode(text, add_special_tokens=False))
    assert got == tokens, f"{got} tokens, not {tokens}"
    return text


# ------------------------------------------------------------------------- kvgate's side

# kvgate's own error codes (proxy/errors.py): what it answers with itself
KVGATE_CODES = frozenset({
    "invalid_request", "context_length_exceeded", "max_tokens_required", "unauthorized",
    "model_not_found", "request_too_large", "queue_full", "queue_timeout", "no_backend",
    "ledger_unavailable", "memory_budget", "upstream_error", "internal_error"})
NOTHING_HELD = {"resident_tokens": 0, "leases": 0, "metric_resident_tokens": 0}


def kvgate_error(got: dict[str, Any]) -> dict[str, Any]:
    """The error object of an answer kvgate gave itself: its shape and one of its codes
    (an engine's own refusal relayed fails this: vLLM's code is the int 400)."""
    data = got.get("json")
    assert isinstance(data, dict) and isinstance(data.get("error"), dict), got
    error: dict[str, Any] = data["error"]
    assert error.get("code") in KVGATE_CODES, f"not one of kvgate's answers: {data}"
    if got["status"] == 400:
        assert error.get("type") == "invalid_request_error", data
    return error


async def reserved_now(s: aiohttp.ClientSession, kvgate_url: str, model: str = TINY_MODEL
                       ) -> dict[str, int]:
    """Tokens reserved and leases held over the model's backends, as kvgate's
    /admin/state and /metrics (`kvgate_resident_tokens`) show them. A lease is released
    just after its answer's last byte: this waits (bounded) for nothing to be held, and
    returns what is held when the bound is reached."""
    held: dict[str, int] = {}
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        async with s.get(f"{kvgate_url}/admin/state") as resp:
            views = (await resp.json())["models"][model]["backends"].values()
        held = {"resident_tokens": sum(v["resident_tokens"] for v in views),
                "leases": sum(v["leases"] for v in views)}
        async with s.get(f"{kvgate_url}/metrics") as resp:
            held["metric_resident_tokens"] = sum(
                int(float(line.rsplit(" ", 1)[1])) for line in (await resp.text()).splitlines()
                if line.startswith("kvgate_resident_tokens{"))
        if not any(held.values()):
            break
        await asyncio.sleep(0.05)
    return held


def assert_served_to_the_context_end(direct: dict[str, Any], via: dict[str, Any], *,
                                     prompt_tokens: int, context: int, stream: bool) -> None:
    """A prompt + max_tokens past the context, straight to the engine (`direct`) and
    through kvgate (`via`): both 200, stopped at the context's end ("length") with the
    same text and usage, kvgate's count the engine's and its reservation the context."""
    assert direct["status"] == 200, direct
    assert via["status"] == 200, via
    assert via["finish"] == direct["finish"] == "length"
    assert via["usage"] == direct["usage"]
    assert via["usage"]["prompt_tokens"] == prompt_tokens
    assert via["usage"]["completion_tokens"] == context - prompt_tokens
    assert via["text"] == direct["text"]
    assert via["headers"]["x-kvgate-prompt-tokens"] == str(prompt_tokens)
    assert via["headers"]["x-kvgate-reserved-tokens"] == str(context)
    if stream:
        assert via["done"] and direct["done"]
        assert via["errors"] == direct["errors"] == []
