"""Simulated GPU backends (two unless asked), with or without kvgate in front, as
separate processes.

A target is how the clients reach the backends: straight (round-robin), straight with
a client-side give-up at kvgate's queue deadline, by consistent hashing of the prompt's
leading text with that give-up (`affinity+timeout`), or through kvgate with one of its
reservation modes (and, for adaptive, with shared prefixes charged once or not).
kvgate may run as several replicas on one Redis ledger, the clients spread over them.
kvgate's configuration is built as a dict and written as TOML, so
a variant (e.g. `reservation = "adaptive"`) is one key in that dict.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from hashlib import blake2b
from pathlib import Path
from typing import Any, cast

import aiohttp
import tomli_w

from benchmarks.suite.loadgen import Result, Sample, client_held
from proxy.ports import free_port
from proxy.stack import spawn_logged, stop_process, wait_port

ROOT = Path(__file__).resolve().parents[2]
QWEN = ROOT / "models" / "qwen3-14b"
MODEL = "qwen3-14b"


class Target(StrEnum):
    DIRECT = "direct"  # clients straight to the backends, round-robin; they wait forever
    DIRECT_TIMEOUT = "direct+timeout"  # ...and give up at kvgate's deadline (to 1st token)
    STRICT = "strict"  # through kvgate, reservation = prompt + max_tokens
    ADAPTIVE = "adaptive"  # through kvgate, reservation = "adaptive" (prefix_sharing auto)
    # clients hash the prompt's first AFFINITY_CHARS characters onto a ring of the
    # backends (AffinityRing) and give up at the deadline like direct+timeout
    AFFINITY_TIMEOUT = "affinity+timeout"
    ADAPTIVE_PREFIX_OFF = "adaptive-prefix-off"  # adaptive, prefix_sharing = "off"
    # A reference, not a contender: one simulated engine holding every backend's pool,
    # clients straight to it giving up at the deadline. Its prefix hit rate is what one
    # cache of the whole fleet's size hits on the same arrivals (M's yardstick).
    ONE_ENGINE = "one-engine"

    @property
    def proxy(self) -> bool:
        return self in (Target.STRICT, Target.ADAPTIVE, Target.ADAPTIVE_PREFIX_OFF)

    @property
    def gives_up(self) -> bool:
        """The client abandons a request without a first token at the deadline."""
        return self in (Target.DIRECT_TIMEOUT, Target.AFFINITY_TIMEOUT, Target.ONE_ENGINE)

    @property
    def reservation(self) -> str:
        return "strict" if self is Target.STRICT else "adaptive"

    @property
    def prefix_sharing(self) -> str:
        return "off" if self is Target.ADAPTIVE_PREFIX_OFF else "auto"

    @property
    def label(self) -> str:
        return f"kvgate {self.value}" if self.proxy else self.value


@dataclass(frozen=True, slots=True, kw_only=True)
class SimParams:
    kv_tokens: int = 16384
    decode_step_ms: float = 20.0
    per_seq_ms: float = 0.2
    prefill_tokens_per_s: float = 40000.0
    max_model_len: int = 8192
    # Off for the scenarios without shared prefixes: their synthetic prompt text
    # repeats one word, which a prefix cache would share as real traffic never does.
    prefix_caching: bool = False
    max_num_seqs: int | None = None  # None: the simulator's default (256)

    def step_s(self, running: float) -> float:
        return (self.decode_step_ms + self.per_seq_ms * running) / 1000


@dataclass(frozen=True, slots=True, kw_only=True)
class GateSettings:
    """kvgate's queue and model settings for one run."""

    deadline_s: float = 3.0
    max_depth: int = 256
    ordering: str = "fifo"
    starvation_s: float = 5.0  # kvgate's default
    output_policy: str = "fill"
    reservation: str = "strict"  # always written: the default mode is no benchmark's business
    prefix_sharing: str = "auto"  # kvgate's default; "off" charges every prompt in full
    ledger_url: str | None = None


class StartFailed(RuntimeError):
    """A process of the cluster did not come up; the message carries its log's tail."""



def kvgate_config(params: SimParams, gate: GateSettings, *, port: int,
                  sims: list[str]) -> dict[str, Any]:
    """kvgate's configuration for the simulated backends `sims`, as the TOML file will hold
    it."""
    model: dict[str, Any] = {
        "name": MODEL, "path": str(QWEN), "max_model_len": params.max_model_len,
        "output_policy": gate.output_policy,
    }
    model["reservation"] = gate.reservation
    model["prefix_sharing"] = gate.prefix_sharing
    model["deployment"] = {"kv_tokens": params.kv_tokens, "block_size": 16}
    model["backends"] = [{"name": f"sim-{i}", "url": u} for i, u in enumerate(sims)]
    config: dict[str, Any] = {
        "server": {"listen": f"127.0.0.1:{port}"},
        "queue": {"max_depth": gate.max_depth, "default_deadline_s": gate.deadline_s,
                  "ordering": gate.ordering, "starvation_s": gate.starvation_s},
    }
    if gate.ledger_url:
        config["ledger"] = {"kind": "redis", "url": gate.ledger_url}
    config["models"] = [model]
    return config


AFFINITY_CHARS = 2048
AFFINITY_VNODES = 64


class AffinityRing:
    """The `affinity+timeout` router: consistent hashing of a prompt's leading text.

    The key is the first `AFFINITY_CHARS` characters of the request's message contents
    joined in order (role, a newline, the content, a newline; for a shared system prompt
    of any real length, that is its opening text). It is hashed (BLAKE2b, 64 bits) onto
    a ring on which each backend, named by its position (`sim-0`, `sim-1`, ...), holds
    `AFFINITY_VNODES` points; the request goes to the first point clockwise. Equal
    leading text always reaches the same backend, whatever the load there: the
    strongest simple prefix router without a gate (no load signal, no admission).
    """

    def __init__(self, backends: int, vnodes: int = AFFINITY_VNODES) -> None:
        points = sorted((_hash64(f"sim-{b}#{v}"), b) for b in range(backends)
                        for v in range(vnodes))
        self._keys = [p for p, _ in points]
        self._owners = [b for _, b in points]

    @staticmethod
    def key(body: Mapping[str, Any]) -> str:
        text = "".join(f"{m.get('role', '')}\n{m.get('content', '')}\n"
                       for m in body.get("messages", ()))
        return text[:AFFINITY_CHARS]

    def backend(self, body: Mapping[str, Any]) -> int:
        i = bisect.bisect_right(self._keys, _hash64(self.key(body)))
        return self._owners[i % len(self._owners)]


def _hash64(text: str) -> int:
    return int.from_bytes(blake2b(text.encode(), digest_size=8).digest(), "big")


def to_toml(data: Mapping[str, Any]) -> str:
    """kvgate's config as TOML, by a TOML writer."""
    return tomli_w.dumps(data)


_SHARED = re.compile(r"^kvgate_shared_prefix_tokens_total\{[^}]*\} (\S+)$", re.MULTILINE)
_METRIC = re.compile(r"^(vllm:[a-z_]+)\{[^}]*\} (\S+)$", re.MULTILINE)


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """vLLM's gauges and counters by name from a /metrics page (one model per backend)."""
    return {m.group(1): float(m.group(2)) for m in _METRIC.finditer(text)}


@dataclass
class Cluster:
    sims: list[str]
    proxy: str | None
    capacity: int
    # every kvgate replica (the first is `proxy`: its /admin/state and /metrics are read
    # for the samples; with a Redis ledger its resident figures are the shared ones)
    replicas: list[str] = field(default_factory=list)
    redis_url: str | None = None  # the replicas' ledger
    samples: list[Sample] = field(default_factory=list)
    results: list[Result] = field(default_factory=list)
    model: str = MODEL  # the served name, as kvgate's /admin/state keys it
    # engines shared by runs (vLLM): their preemption count when this run began
    preemptions_base: int = 0

    @property
    def kvgates(self) -> list[str]:
        """Every kvgate process in front (none for the direct targets)."""
        return self.replicas or ([self.proxy] if self.proxy else [])

    @property
    def targets(self) -> list[str]:
        return self.kvgates or self.sims

    def watch(self, results: list[Result]) -> None:
        """The live results, for the clients' view of what the engines hold."""
        self.results = results

    async def engine_totals(self) -> dict[str, float]:
        """The engines' counters at the end, summed: preemptions, prefix-cache hit and
        query tokens; and kvgate's shared-prefix tokens when it is in front."""
        totals = {"preemptions": 0.0, "prefix_hits": 0.0, "prefix_queries": 0.0}
        async with aiohttp.ClientSession() as s:
            for url in self.sims:
                async with s.get(f"{url}/metrics") as resp:
                    m = parse_vllm_metrics(await resp.text())
                totals["preemptions"] += m["vllm:num_preemptions_total"]
                totals["prefix_hits"] += m.get("vllm:prefix_cache_hits_total", 0.0)
                totals["prefix_queries"] += m.get("vllm:prefix_cache_queries_total", 0.0)
            totals["preemptions"] -= self.preemptions_base
            if self.kvgates:
                totals["kvgate_shared"] = 0.0
            for url in self.kvgates:
                async with s.get(f"{url}/metrics") as resp:
                    text = await resp.text()
                totals["kvgate_shared"] += sum(float(v) for v in _SHARED.findall(text))
        return totals

    async def end_state(self, settle_s: float = 10.0) -> dict[str, float]:
        """What kvgate still holds once every client is done: per replica, summed over
        backends, the ledger's resident tokens, leases, requests in flight and tokens in
        shared blocks; waits up to `settle_s` for them to reach zero (a lease whose
        client hung up at the hard stop is released when kvgate notices the hang-up)."""
        async with aiohttp.ClientSession() as s:
            loop_deadline = asyncio.get_running_loop().time() + settle_s
            while True:
                held = {"end_resident": 0, "end_leases": 0, "end_inflight": 0,
                        "end_shared": 0}
                for url in self.kvgates:
                    async with s.get(f"{url}/admin/state") as resp:
                        views = (await resp.json())["models"][self.model]["backends"]
                    for b in views.values():
                        held["end_resident"] += b["resident_tokens"]
                        held["end_leases"] += b["leases"]
                        held["end_inflight"] += b["inflight"]
                        held["end_shared"] += b["shared_prefix_resident_tokens"]
                if self.redis_url is not None:
                    held["end_refs"] = self._block_refs()
                if not any(held.values()) or asyncio.get_running_loop().time() > loop_deadline:
                    return {k: float(v) for k, v in held.items()}
                await asyncio.sleep(0.1)

    def _block_refs(self) -> int:
        """Block keys still referenced in the Redis ledger, over every backend."""
        import redis

        from tests.support.redis_server import block_fields

        assert self.redis_url is not None
        client = redis.Redis.from_url(self.redis_url)
        try:
            return sum(len(block_fields(cast(list[bytes], client.hkeys(key))))
                       for key in client.scan_iter(match="*:refs"))
        finally:
            client.close()

    async def sample(self, t: float) -> None:
        """One point: the engines' own KV use, queues and preemptions; kvgate's view."""
        timeout = aiohttp.ClientTimeout(total=1.0)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            usage = 0.0
            per_backend = []
            running = waiting = preemptions = 0
            for url in self.sims:
                async with s.get(f"{url}/metrics") as resp:
                    m = parse_vllm_metrics(await resp.text())
                usage += m["vllm:kv_cache_usage_perc"]
                per_backend.append(m["vllm:kv_cache_usage_perc"])
                running += int(m["vllm:num_requests_running"])
                waiting += int(m["vllm:num_requests_waiting"])
                preemptions += int(m["vllm:num_preemptions_total"])
            reserved = queued = None
            held: tuple[int, ...] = ()
            targets: tuple[int, ...] = ()
            if self.proxy:
                async with s.get(f"{self.proxy}/admin/state") as resp:
                    model = (await resp.json())["models"][self.model]
                by_name = model["backends"]  # sim-0, sim-1, ...: the engines' order
                views = [by_name[k] for k in sorted(
                    by_name, key=lambda k: int(k.rsplit("-", 1)[1]))]
                reserved = sum(b["resident_tokens"] for b in views)
                queued = int(model["queue_depth"])
                for url in self.replicas[1:]:  # each replica queues its own clients
                    async with s.get(f"{url}/admin/state") as resp:
                        queued += int((await resp.json())["models"][self.model]["queue_depth"])
                held = tuple(int(b["resident_tokens"]) for b in views)
                targets = tuple(int(b["admission_target_tokens"]) for b in views)
        kv_use = usage / len(self.sims)  # equal pools: the mean is the whole pool's share
        self.samples.append(Sample(
            t=t, kv_use=kv_use, resident=round(kv_use * self.capacity), reserved=reserved,
            capacity=self.capacity, queued=queued, engine_waiting=waiting, running=running,
            preemptions=preemptions - self.preemptions_base,
            kv_per_backend=tuple(per_backend),
            client_held=client_held(self.results), reserved_per_backend=held,
            target_per_backend=targets))

    async def preemptions(self) -> int:
        async with aiohttp.ClientSession() as s:
            total = 0
            for url in self.sims:
                async with s.get(f"{url}/metrics") as resp:
                    total += int(parse_vllm_metrics(await resp.text())
                                 ["vllm:num_preemptions_total"])
            return total - self.preemptions_base


def _start(cmd: list[str], log: Path, port: int, name: str,
           procs: list[subprocess.Popen[bytes]]) -> None:
    proc = spawn_logged(cmd, log)
    procs.append(proc)
    try:
        wait_port(port, proc, name)
    except RuntimeError as exc:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
        raise StartFailed(f"{exc}: {' / '.join(tail)}") from exc


@contextlib.contextmanager
def cluster(params: SimParams, *, gate: GateSettings | None = None,
            seed: int = 0, backends: int = 2, replicas: int = 1) -> Iterator[Cluster]:
    """`backends` fresh simulated backends, and kvgate in front when `gate` is given:
    `replicas` processes, on a fresh redis-server's ledger when there are several."""
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as tmp, \
            contextlib.ExitStack() as stack:
        try:
            sims = []
            for i in range(backends):
                port = free_port()
                _start([sys.executable, "-m", "proxy", "sim", "--port", str(port),
                        "--kv-tokens", str(params.kv_tokens), "--model", MODEL,
                        "--model-dir", str(QWEN), "--output-len", "max",
                        "--decode-step-ms", str(params.decode_step_ms),
                        "--per-seq-ms", str(params.per_seq_ms),
                        "--prefill-tokens-per-s", str(params.prefill_tokens_per_s),
                        "--max-model-len", str(params.max_model_len), "--seed", str(seed + i),
                        *([] if params.prefix_caching else ["--no-prefix-caching"]),
                        *([] if params.max_num_seqs is None
                          else ["--max-num-seqs", str(params.max_num_seqs)])],
                       Path(tmp) / f"sim{i}.log", port, f"sim {i}", procs)
                sims.append(f"http://127.0.0.1:{port}")
            urls: list[str] = []
            if gate is not None and replicas > 1:
                from tests.support.redis_server import RedisServer

                redis = RedisServer(Path(tmp))
                redis.start()
                stack.callback(redis.stop)
                gate = replace(gate, ledger_url=redis.url)
            for i in range(replicas if gate is not None else 0):
                assert gate is not None
                port = free_port()
                config = Path(tmp) / f"kvgate{i}.toml"
                config.write_text(to_toml(kvgate_config(params, gate, port=port, sims=sims)))
                _start([sys.executable, "-m", "proxy", "serve", "--config", str(config)],
                       Path(tmp) / f"kvgate{i}.log", port, f"kvgate {i}", procs)
                urls.append(f"http://127.0.0.1:{port}")
            yield Cluster(sims=sims, proxy=urls[0] if urls else None,
                          capacity=backends * params.kv_tokens,
                          replicas=urls if len(urls) > 1 else [],
                          redis_url=gate.ledger_url if gate is not None else None)
        finally:
            for proc in reversed(procs):
                stop_process(proc)
