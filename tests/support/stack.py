"""A proxy in front of simulated backends, all on 127.0.0.1, inside one event loop."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from proxy.config import parse_config
from proxy.runtime import Runtime
from proxy.server import RUNTIME_KEY, start_proxy
from proxy.sim.engine import EngineConfig, OutputLength
from proxy.sim.server import SimSettings, bound_port, start_sim

MODELS = Path(__file__).resolve().parents[2] / "models"
MODEL = "qwen3-14b"


@dataclass
class Stack:
    url: str
    sims: list[str]
    state: Runtime

    async def sim_state(self, session: aiohttp.ClientSession, i: int) -> dict[str, Any]:
        async with session.get(f"{self.sims[i]}/sim/state") as resp:
            data: dict[str, Any] = await resp.json()
            return data

    def resident(self) -> dict[str, int]:
        return {b.name: self.state.ledger.resident(b.name) for b in self.state.backends()}


@contextlib.asynccontextmanager
async def running_stack(
    *,
    backends: int = 2,
    kv_tokens: int = 4096,
    queue: dict[str, Any] | None = None,
    model: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
    extra_backend_urls: list[str] | None = None,
    server: dict[str, Any] | None = None,
    backend: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    model_name: str = MODEL,
    max_model_len: int = 8192,
) -> AsyncIterator[Stack]:
    """`model_name`: a folder of `models/`, served by the simulated backends and kvgate
    alike; `max_model_len`: both sides' context."""
    sims: list[web.AppRunner] = []
    proxy: web.AppRunner | None = None
    try:
        for i in range(backends):
            settings = SimSettings(
                engine=EngineConfig(**{"kv_tokens": kv_tokens, "output_length": OutputLength.MAX,
                                       "seed": i, **(engine or {})}),
                model=model_name, model_dir=str(MODELS / model_name),
                max_model_len=max_model_len,
            )
            sims.append(await start_sim(settings, "127.0.0.1", 0))
        urls = [f"http://127.0.0.1:{bound_port(r)}" for r in sims] + (extra_backend_urls or [])
        data = {
            "server": {"listen": "127.0.0.1:0", "health_interval_s": 0.2, **(server or {})},
            "queue": {"max_depth": 64, "default_deadline_s": 5.0, **(queue or {})},
            "models": [{
                "name": model_name, "path": str(MODELS / model_name),
                "max_model_len": max_model_len,
                "reservation": "strict",  # the tests of prompt + max_tokens; adaptive has its own
                "deployment": {"kv_tokens": kv_tokens, "block_size": 16},
                "backends": [{"name": f"sim-{i}", "url": u, **(backend or {})}
                             for i, u in enumerate(urls)],
                **(model or {}),
            }],
            **(extra or {}),
        }
        config = parse_config(data, base=Path.cwd())
        proxy = await start_proxy(config, port=0)
        yield Stack(url=f"http://127.0.0.1:{bound_port(proxy)}", sims=urls,
                    state=proxy.app[RUNTIME_KEY])
    finally:
        if proxy is not None:
            await proxy.cleanup()
        for runner in sims:
            await runner.cleanup()
