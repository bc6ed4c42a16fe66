"""Health probes against a backend that answers late, or answers 503.

A busy engine on a saturated host answers its health route late; counted down at the
first late answer, it had every request of the next seconds refused 503 `no_backend`
while it was serving them. One late answer is forgiven, two in a row are not
(`proxy.upstream.MISSED_PROBES_UNHEALTHY`); a 5xx is down at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from proxy.leases import Backend
from proxy.sim.server import bound_port
from proxy.upstream import MISSED_PROBES_UNHEALTHY
from tests.support.stack import Stack, running_stack

PROBE_TIMEOUT_S = 2.0  # proxy.upstream's


@dataclass
class Health:
    late: int = 0  # the next probes answered after the timeout
    late_forever: bool = False
    status: int = 200
    probes: int = 0


@contextlib.asynccontextmanager
async def kvgate_before(health: Health) -> AsyncIterator[tuple[Stack, Backend]]:
    async def probe(_request: web.Request) -> web.Response:
        health.probes += 1
        if health.late_forever or health.late > 0:
            health.late = max(0, health.late - 1)
            await asyncio.sleep(PROBE_TIMEOUT_S + 0.5)
        return web.Response(status=health.status)

    app = web.Application()
    app.router.add_get("/health", probe)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        url = f"http://127.0.0.1:{bound_port(runner)}"
        async with running_stack(backends=0, extra_backend_urls=[url]) as stack:
            backend = stack.state.backends()[0]
            async with asyncio.timeout(5):
                while not backend.healthy:
                    await asyncio.sleep(0.02)
            yield stack, backend
    finally:
        await runner.cleanup()


async def healthy_throughout(backend: Backend, seconds: float) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        if not backend.healthy:
            return False
        await asyncio.sleep(0.02)
    return True


def test_one_late_probe_is_forgiven_and_late_ones_in_a_row_are_not() -> None:
    assert MISSED_PROBES_UNHEALTHY == 2

    async def scenario() -> None:
        health = Health()
        async with kvgate_before(health) as (_stack, backend):
            health.late = 1
            before = health.probes
            # the late probe times out, the next answers at once: healthy all along
            assert await healthy_throughout(backend, PROBE_TIMEOUT_S + 1.0)
            assert health.probes >= before + 2 and health.late == 0
            health.late_forever = True
            loop = asyncio.get_running_loop()
            start = loop.time()
            async with asyncio.timeout(4 * PROBE_TIMEOUT_S + 2):
                while backend.healthy:
                    await asyncio.sleep(0.02)
            assert loop.time() - start >= 2 * PROBE_TIMEOUT_S - 0.5  # not at the first
            health.late_forever = False
            async with asyncio.timeout(PROBE_TIMEOUT_S + 2):
                while not backend.healthy:
                    await asyncio.sleep(0.02)

    asyncio.run(scenario())


def test_a_5xx_health_answer_is_down_at_once() -> None:
    async def scenario() -> None:
        health = Health()
        async with kvgate_before(health) as (_stack, backend):
            health.status = 503
            async with asyncio.timeout(1.0):  # the next probe, 0.2 s away
                while backend.healthy:
                    await asyncio.sleep(0.02)

    asyncio.run(scenario())
