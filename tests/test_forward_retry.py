"""A request lost on a stale pooled connection is sent again; one that may have been read is not.

llama.cpp's `llama-server` closes the connection after every streamed answer without
saying so (no `Connection: close`): the last chunk arrives, aiohttp puts the
connection back in its pool, and the peer's FIN comes a moment later. kvgate hands the
freed room to the next waiter in between, and that waiter's POST goes out on the dead
connection. These backends are raw HTTP/1.1 on asyncio streams, so the way each
connection ends is exactly the one written here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from tests.support.stack import MODEL, Stack, running_stack

MSGS = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass
class Counts:
    gets: int = 0
    chats: int = 0  # chat requests read, answered or not
    answered: int = 0
    dropped: int = 0  # chat requests read, then the connection closed unanswered
    connections: int = 0


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(delta: dict[str, str], finish: str | None = None) -> bytes:
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return _chunk(f"data: {json.dumps(chunk)}\n\n".encode())


class RawBackend:
    """One chat endpoint (a short SSE answer, whatever was asked) and 200 to any GET.

    `close_after_stream`: llama-server's way: the answer ends cleanly on the wire (the
    terminating chunk, no `Connection: close`), then the socket closes `close_delay_s`
    later without reading what arrived meanwhile. `drop_idle_s`: a chat request that
    comes on a connection idle that long since its last answer is read and the socket
    closed, no byte back (a keep-alive timer that fires as the request arrives; a fresh
    connection is never idle).
    `hang_up`: every chat request is read, then the socket closes ("close") or is reset
    ("reset"), no byte back. `close_every_response`: every answer says `Connection:
    close` and the socket closes after it, so nothing is ever pooled: every request goes
    out on a fresh connection.
    """

    def __init__(self, *, close_after_stream: bool = False, close_delay_s: float = 0.002,
                 drop_idle_s: float | None = None, hang_up: str | None = None,
                 close_every_response: bool = False) -> None:
        self.close_after_stream = close_after_stream
        self.close_delay_s = close_delay_s
        self.drop_idle_s = drop_idle_s
        self.hang_up = hang_up
        self.close_every_response = close_every_response
        self.counts = Counts()
        self.handlers: set[asyncio.Task[None]] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        self.counts.connections += 1
        try:
            await self._serve(reader, writer)
        finally:
            self.handlers.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        idle_since = loop.time()
        close = b"Connection: close\r\n" if self.close_every_response else b""
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            lines = head.decode("latin-1").split("\r\n")
            method = lines[0].split(" ", 1)[0]
            fields = {k.lower(): v for k, _, v in (line.partition(": ") for line in lines[1:])}
            if length := int(fields.get("content-length", 0)):
                await reader.readexactly(length)
            if method == "GET":
                self.counts.gets += 1
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n" + close + b"\r\n")
                await writer.drain()
                if close:
                    return
                idle_since = loop.time()
                continue
            self.counts.chats += 1
            idle = loop.time() - idle_since
            if self.hang_up is not None or (
                    self.drop_idle_s is not None and idle >= self.drop_idle_s):
                self.counts.dropped += 1
                if self.hang_up == "reset":
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n" + close + b"\r\n"
                         + _event({"role": "assistant", "content": ""}))
            for word in ("Paris", "."):
                await asyncio.sleep(0.001)
                writer.write(_event({"content": word}))
            writer.write(_event({}, finish="length") + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
            self.counts.answered += 1
            idle_since = loop.time()
            if close:
                return
            if self.close_after_stream:
                await asyncio.sleep(self.close_delay_s)
                return


@contextlib.asynccontextmanager
async def kvgate_before(backend: RawBackend, **stack: Any) -> AsyncIterator[Stack]:
    """kvgate in front of `backend`, once kvgate's health probe has reached it."""
    server = await asyncio.start_server(backend.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with running_stack(backends=0, extra_backend_urls=[f"http://127.0.0.1:{port}"],
                                 **stack) as kvgate:
            async with asyncio.timeout(5):
                while not (kvgate.state.backends()[0].healthy and backend.counts.gets):
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.05)  # the probe's answer read, its connection pooled
            yield kvgate
    finally:
        server.close()
        await server.wait_closed()
        if backend.handlers:  # kvgate has closed its connections: they end on their own
            await asyncio.wait(backend.handlers, timeout=5)


async def stream_once(s: aiohttp.ClientSession, stack: Stack,
                      max_tokens: int = 900) -> tuple[int, bytes]:
    body = {"model": MODEL, "messages": MSGS, "max_tokens": max_tokens, "stream": True}
    async with s.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
        return resp.status, await resp.read()


async def streams(stack: Stack, n: int, max_tokens: int = 900) -> list[tuple[int, bytes]]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        return await asyncio.gather(*(stream_once(s, stack, max_tokens) for _ in range(n)))


def completed(results: list[tuple[int, bytes]]) -> bool:
    return all(status == 200 and body.rstrip().endswith(b"data: [DONE]")
               for status, body in results)


# 900 output tokens and a short prompt: four requests fit in 4096 tokens of KV cache,
# the rest wait in kvgate's queue and each is dispatched as an answer ends.
QUEUED: dict[str, Any] = {"queue": {"max_depth": 256, "default_deadline_s": 60.0}}


def test_streams_queued_behind_a_backend_that_closes_after_each_answer_all_succeed() -> None:
    """200 streams through 4 slots: without the resend about half were a 502."""
    backend = RawBackend(close_after_stream=True)

    async def scenario() -> None:
        async with kvgate_before(backend, **QUEUED) as stack:
            started = time.perf_counter()
            async with asyncio.timeout(60):
                results = await streams(stack, 200)
            elapsed = time.perf_counter() - started
        statuses = [status for status, _ in results]
        assert statuses.count(502) == 0, (statuses.count(502), elapsed)
        assert completed(results), [body[-300:] for status, body in results
                                    if not completed([(status, body)])]
        # a dead connection's request was never read: the backend saw each once
        assert backend.counts.answered == backend.counts.chats == 200
        assert backend.counts.connections <= 200 + 2  # one per answer, the probe's
        assert elapsed < 30

    asyncio.run(scenario())


def test_streams_on_keep_alive_connections_the_backend_closed_while_idle_succeed() -> None:
    backend = RawBackend(drop_idle_s=0.1)

    async def scenario() -> None:
        async with kvgate_before(backend, server={"health_interval_s": 30.0}, **QUEUED) as stack:
            async with asyncio.timeout(30):
                first = await streams(stack, 8)
                pooled = backend.counts.connections
                await asyncio.sleep(0.15)  # every pooled connection is now past its time
                second = await streams(stack, 8)
        statuses = [status for status, _ in first + second]
        assert statuses.count(502) == 0, statuses.count(502)
        assert completed(first) and completed(second)
        assert backend.counts.answered == 16
        # a request is sent again only after a pooled connection dropped it, and each
        # connection drops one at most: never more resends than connections there were
        assert 0 < backend.counts.dropped <= pooled
        assert backend.counts.chats == 16 + backend.counts.dropped

    asyncio.run(scenario())


def test_resends_stop_after_four() -> None:
    """A dozen pooled connections, all closed by the backend as the request comes: the
    first send and four more are lost, and the fifth failure is the answer."""
    backend = RawBackend(drop_idle_s=0.1)

    async def scenario() -> None:
        async with kvgate_before(backend, server={"health_interval_s": 30.0}) as stack:
            async with asyncio.timeout(30):
                assert completed(await streams(stack, 12, max_tokens=5))  # all at once
                pooled, chats, dropped = (backend.counts.connections, backend.counts.chats,
                                          backend.counts.dropped)
                assert pooled - dropped > 5
                await asyncio.sleep(0.15)
                [(status, body)] = await streams(stack, 1, max_tokens=5)
        assert status == 502 and b"upstream_error" in body
        assert backend.counts.dropped - dropped == 1 + 4
        assert backend.counts.chats - chats == 1 + 4
        assert backend.counts.connections == pooled  # no fresh connection was tried

    asyncio.run(scenario())


@pytest.mark.parametrize("how", ["close", "reset"])
def test_a_request_lost_on_a_fresh_connection_is_not_sent_again(how: str) -> None:
    """Nothing pooled: the backend read it and hung up, so it may be working on it."""
    backend = RawBackend(hang_up=how, close_every_response=True)

    async def scenario() -> None:
        async with kvgate_before(backend) as stack, aiohttp.ClientSession() as s:
            body = {"model": MODEL, "messages": MSGS, "max_tokens": 5, "stream": True}
            async with s.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                data = await resp.json()
            assert (resp.status, data["error"]["code"]) == (502, "upstream_error"), data
            assert stack.resident() == {"sim-0": 0}
        assert backend.counts.chats == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("how", ["close", "reset"])
def test_a_request_lost_on_a_reused_connection_goes_once_more_on_a_fresh_one(how: str) -> None:
    """The probe's pooled connection, then a fresh one: two sends, then the 502."""
    backend = RawBackend(hang_up=how)

    async def scenario() -> None:
        # sharing off: its engine poll would pool connections of its own (GET /metrics)
        async with kvgate_before(backend, server={"health_interval_s": 30.0},
                                 model={"prefix_sharing": "off"}) as stack, \
                aiohttp.ClientSession() as s:
            body = {"model": MODEL, "messages": MSGS, "max_tokens": 5}
            async with s.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                data = await resp.json()
            assert (resp.status, data["error"]["code"]) == (502, "upstream_error"), data
            assert stack.resident() == {"sim-0": 0}
        assert backend.counts.chats == 2
        assert backend.counts.connections == 2

    asyncio.run(scenario())
