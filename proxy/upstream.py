"""What kvgate asks its backends outside requests: health, capacity and engine figures.

The background loops of `kvgate serve`, over the app's client session. The decisions
they feed (health, capacity, admission targets) are the gate's and the controller's;
this module only reads the engines over HTTP.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import aiohttp

from policies.engines import EngineKind
from proxy.admission import Backend
from proxy.engine_metrics import EngineLoad, engine_load, kv_capacity_tokens
from proxy.runtime import Runtime

__all__ = ["EngineReader", "LlamaProps", "health_loop", "llama_props"]

log = logging.getLogger("kvgate")
_PROBE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
MISSED_PROBES_UNHEALTHY = 2
"""Probes in a row left unanswered within the timeout before a healthy backend counts
as unhealthy. An engine busy on a long prefill on a saturated host answers its health
route late: llama-server missed one 2 s probe, and every request of the next seconds
got 503 `no_backend` while it was serving. A backend that refuses the connection or
answers 5xx is down at once."""


async def _get_text(session: aiohttp.ClientSession, url: str) -> str | None:
    """The body of a 200 answer, or None for any failure (a probe never raises)."""
    try:
        async with session.get(url, timeout=_PROBE_TIMEOUT) as resp:
            if resp.status != 200:
                return None
            return await resp.text()
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return None


async def _probe(session: aiohttp.ClientSession, backend: Backend) -> bool | None:
    """Up, down, or None: no answer within the timeout (busy, or gone: the next probes
    tell which)."""
    try:
        async with session.get(f"{backend.url}/health", timeout=_PROBE_TIMEOUT) as resp:
            return resp.status < 500
    except TimeoutError:
        return None
    except aiohttp.ClientError:
        return False


class EngineReader:
    """One scrape of a backend's `/metrics`, as the gate's engine feedback reads it."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self._session = session

    async def __call__(self, backend: Backend) -> EngineLoad | None:
        text = await _get_text(self._session, f"{backend.url}/metrics")
        return None if text is None else engine_load(text)


@dataclass(frozen=True, slots=True)
class LlamaProps:
    """What llama.cpp's `/props` says of its pool: `total_slots` requests run at once
    (its `-np`), each within `n_ctx` tokens. With one unified KV pool (its default
    without `-np`) `n_ctx` is the whole pool; with a pool split per slot it is one
    slot's share. /props does not say which, so `n_ctx` is the capacity kvgate reads:
    exact for a unified pool, on the safe side (a slot's share) for a split one."""

    total_slots: int
    n_ctx: int


def llama_props(text: str | None) -> LlamaProps | None:
    if not text:
        return None
    try:
        data = json.loads(text)
        slots = data["total_slots"]
        n_ctx = data["default_generation_settings"]["n_ctx"]
    except (ValueError, KeyError, TypeError):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1
               for v in (slots, n_ctx)):
        return None
    return LlamaProps(total_slots=slots, n_ctx=n_ctx)


async def health_loop(runtime: Runtime, session: aiohttp.ClientSession) -> None:
    """Probe every backend each `health_interval_s`; where the model takes its capacity
    from the engine (`capacity_from_backend`), a backend is ready once it reports one:
    vLLM in `/metrics` (`cache_config_info`), llama.cpp in `/props`. llama.cpp's slot
    count is a second ceiling where the config gives none: more requests would wait
    inside the engine, where no deadline or priority of kvgate's applies."""
    interval = runtime.config.server.health_interval_s
    missed: dict[str, int] = {}  # probes in a row without an answer, by backend
    while True:
        for gate in runtime.gates.values():
            controller = gate.controller
            for backend, configured in zip(gate.backends, gate.config.backends, strict=True):
                answer = await _probe(session, backend)
                if answer is None:
                    missed[backend.name] = missed.get(backend.name, 0) + 1
                    healthy = (backend.healthy
                               and missed[backend.name] < MISSED_PROBES_UNHEALTHY)
                else:
                    missed[backend.name] = 0
                    healthy = answer
                props = None  # read from an engine that answered, not one that is late
                if answer and configured.kind is EngineKind.LLAMA_CPP:
                    props = llama_props(await _get_text(session, f"{backend.url}/props"))
                if props is not None and configured.slots is None \
                        and props.total_slots != backend.slots:
                    log.warning("backend %s runs %d requests at once (llama.cpp slots)",
                                backend.name, props.total_slots)
                    controller.set_slots(backend, props.total_slots)
                if answer and gate.config.capacity_from_backend:
                    if configured.kind is EngineKind.LLAMA_CPP:
                        measured = None if props is None else props.n_ctx
                    else:
                        text = await _get_text(session, f"{backend.url}/metrics")
                        measured = None if text is None else kv_capacity_tokens(text)
                    if measured is not None and measured != backend.capacity_tokens:
                        log.warning("backend %s reports %d KV tokens (was %d)", backend.name,
                                    measured, backend.capacity_tokens)
                        controller.set_capacity(backend, measured)
                        runtime.metrics.capacity_changed(backend.name, measured)
                    healthy = backend.capacity_tokens > 0
                if healthy != backend.healthy:
                    log.warning("backend %s is %s", backend.name,
                                "healthy" if healthy else "unhealthy")
                    controller.set_healthy(backend, healthy)
        await asyncio.sleep(interval)
