"""The simulator's stream starts as vLLM's does: headers at once, the body with the first token.

vLLM answers a stream with Starlette's StreamingResponse over its stream generator:
Starlette sends the headers before it asks the generator for anything (uvicorn writes
them on `http.response.start`), and the generator yields its first chunk, the role, on
the first engine output, the first generated token, right before that token's chunk.
A request waiting in the engine therefore shows its headers and no byte of its body.
Measured here on the wire, over a raw socket, against the engine's own schedule.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from proxy.sim.engine import EngineConfig, OutputLength, SimEngine
from proxy.sim.server import ENGINE_KEY, SimSettings, bound_port, start_sim

STEP_S = 0.02


@dataclass
class Arrival:
    sent: float
    head: float  # the header block complete
    body: float  # the first byte after it
    first_chunk: bytes  # the data of the body's first HTTP chunk
    raw: bytes


def _first_chunk(body: bytes) -> bytes:
    size, _, rest = body.partition(b"\r\n")
    return rest[:int(size, 16)]


async def raw_stream(port: int, body: dict[str, object]) -> Arrival:
    """POST over a plain socket, timing each read as it lands."""
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nConnection: close\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    sent = loop.time()
    buf = b""
    head = first = None
    try:
        while piece := await reader.read(65536):
            now = loop.time()
            buf += piece
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                continue
            if head is None:
                head = now
            if first is None and len(buf) > end + 4:
                first = now
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    assert head is not None and first is not None, buf
    end = buf.index(b"\r\n\r\n") + 4
    assert buf.startswith(b"HTTP/1.1 200"), buf[:end]
    return Arrival(sent=sent, head=head, body=first, first_chunk=_first_chunk(buf[end:]),
                   raw=buf)


@contextlib.asynccontextmanager
async def sim_with_schedule(**engine: object) -> AsyncIterator[tuple[int, dict[int, float]]]:
    """A simulator, and when the engine started each sequence (by seq_id)."""
    config = EngineConfig(**{"output_length": OutputLength.MAX, **engine})  # type: ignore[arg-type]
    runner = await start_sim(SimSettings(engine=config), "127.0.0.1", 0)
    try:
        sim: SimEngine = runner.app[ENGINE_KEY]
        loop = asyncio.get_running_loop()
        started: dict[int, float] = {}
        schedule = sim._schedule

        def timed() -> int:
            waiting = list(sim._waiting)
            prefill = schedule()
            for seq in waiting:
                if seq.blocks and seq.seq_id not in started:
                    started[seq.seq_id] = loop.time()
            return prefill

        sim._schedule = timed  # type: ignore[method-assign]
        yield bound_port(runner), started
    finally:
        await runner.cleanup()


def chat(max_tokens: int) -> dict[str, object]:
    # 206 tokens by the simulator's estimate: 13 of the 16 blocks below
    return {"model": "sim-model", "messages": [{"role": "user", "content": "x" * 800}],
            "max_tokens": max_tokens, "stream": True}


def test_a_waiting_request_shows_headers_and_no_body_until_its_first_token() -> None:
    async def scenario() -> None:
        # without prefix caching: with it, the second's equal prompt shares 12 blocks
        async with sim_with_schedule(kv_tokens=256, decode_step_ms=STEP_S * 1000,
                                     prefix_caching=False) as (port, started):
            first = asyncio.create_task(raw_stream(port, chat(10)))
            async with asyncio.timeout(2):
                while 0 not in started:
                    await asyncio.sleep(0.001)
            # the engine is full: the second waits until the first has finished
            second = await raw_stream(port, chat(10))
            one = await first
        # the first too: nothing of its body before its first step
        assert one.body >= started[0] + STEP_S * 0.9
        assert started[1] >= started[0] + 10 * STEP_S * 0.9
        assert second.head - second.sent < 0.1  # the headers went at once, as vLLM's
        assert second.head < started[1]
        # not a byte of the body while it waited, nor while its first step ran
        assert second.body >= started[1] + STEP_S * 0.9, (second.body - second.sent,
                                                         started[1] - second.sent)
        for arrival in (one, second):
            # the role chunk leaves with the first token, in one write
            events = [e for e in arrival.first_chunk.split(b"\n\n") if e]
            assert len(events) == 2, events
            role, token = (json.loads(e.removeprefix(b"data: ")) for e in events)
            assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert token["choices"][0]["delta"] == {"content": " the"}
            assert arrival.raw.rstrip().endswith(b"data: [DONE]\n\n\r\n0")

    asyncio.run(scenario())
