"""Start real servers on 127.0.0.1 with free ports, inside a test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from proxy.sim.engine import EngineConfig
from proxy.sim.server import SimSettings, bound_port, start_sim


@contextlib.asynccontextmanager
async def running_sim(**kwargs: Any) -> AsyncIterator[str]:
    """Yield the base URL of a simulated backend; engine options as keyword arguments."""
    settings_keys = {"model", "model_dir", "max_model_len"}
    settings_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in settings_keys}
    settings = SimSettings(engine=EngineConfig(**kwargs), **settings_kwargs)
    runner = await start_sim(settings, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{bound_port(runner)}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def fake_backend(chat_handler: Any, **get_routes: Any) -> AsyncIterator[str]:
    """A minimal backend: the given chat handler, a healthy /health, and GET handlers
    by path (`props=handler` serves /props)."""
    from aiohttp import web

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat_handler)
    app.router.add_get("/health", health)
    for name, handler in get_routes.items():
        app.router.add_get(f"/{name}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{bound_port(runner)}"
    finally:
        await runner.cleanup()


async def wait_status(session: Any, url: str, status: int, *, timeout_s: float,
                      interval_s: float = 0.05) -> None:
    """Poll `url` until it answers `status` (connection errors count as not yet)."""
    import aiohttp

    async with asyncio.timeout(timeout_s):
        while True:
            try:
                async with session.get(url) as resp:
                    if resp.status == status:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(interval_s)
