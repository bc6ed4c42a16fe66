"""What kvgate asks its backends outside requests: health, capacity and engine figures.

The background loops of `kvgate serve`, over the app's client session. The decisions
they feed (health, capacity, admission targets) are the gate's and the controller's;
this module only reads the engines over HTTP.
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp

from policies.engines import EngineKind
from proxy.admission import AdmissionController, Backend
from proxy.engine_metrics import EngineLoad, engine_load, kv_capacity_tokens
from proxy.runtime import Runtime

__all__ = ["EngineReader", "health_loop"]

log = logging.getLogger("kvgate")
_PROBE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)


async def _get_text(session: aiohttp.ClientSession, url: str) -> str | None:
    """The body of a 200 answer, or None for any failure (a probe never raises)."""
    try:
        async with session.get(url, timeout=_PROBE_TIMEOUT) as resp:
            if resp.status != 200:
                return None
            return await resp.text()
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return None


async def _probe(session: aiohttp.ClientSession, backend: Backend) -> bool:
    try:
        async with session.get(f"{backend.url}/health", timeout=_PROBE_TIMEOUT) as resp:
            return resp.status < 500
    except (aiohttp.ClientError, TimeoutError):
        return False


class EngineReader:
    """One scrape of a backend's `/metrics`, as the gate's engine feedback reads it."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self._session = session

    async def __call__(self, backend: Backend) -> EngineLoad | None:
        text = await _get_text(self._session, f"{backend.url}/metrics")
        return None if text is None else engine_load(text)


async def _read_slots(session: aiohttp.ClientSession, controller: AdmissionController,
                      backend: Backend) -> None:
    """llama.cpp runs `total_slots` requests at once (its `-np`) and queues the rest
    inside, where no deadline or priority of kvgate's applies: a second ceiling."""
    text = await _get_text(session, f"{backend.url}/props")
    try:
        slots = json.loads(text).get("total_slots") if text else None
    except (ValueError, AttributeError):
        return
    if isinstance(slots, int) and not isinstance(slots, bool) and slots >= 1 \
            and slots != backend.slots:
        log.warning("backend %s runs %d requests at once (llama.cpp slots)", backend.name,
                    slots)
        controller.set_slots(backend, slots)


async def health_loop(runtime: Runtime, session: aiohttp.ClientSession) -> None:
    """Probe every backend each `health_interval_s`; where the model takes its capacity
    from the engine (`capacity_from_backend`), a backend is ready once it reports one."""
    interval = runtime.config.server.health_interval_s
    while True:
        for gate in runtime.gates.values():
            controller = gate.controller
            for backend, configured in zip(gate.backends, gate.config.backends, strict=True):
                healthy = await _probe(session, backend)
                if healthy and configured.kind is EngineKind.LLAMA_CPP and configured.slots is None:
                    await _read_slots(session, controller, backend)
                if healthy and gate.config.capacity_from_backend:
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
