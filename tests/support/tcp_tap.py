"""A loopback TCP relay that can swallow the server's replies: a lost reply, on demand."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class ReplyDroppingRelay:
    """Relays 127.0.0.1:port <-> target; while `drop_replies` is set, the server's
    bytes are read and thrown away, so requests arrive and run but answers never come."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.drop_replies = False
        self.port = 0
        self._server: asyncio.Server | None = None

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    replies: bool) -> None:
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while data := await reader.read(65536):
                if replies and self.drop_replies:
                    continue
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _handle(self, client_r: asyncio.StreamReader,
                      client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        await asyncio.gather(self._pipe(client_r, server_w, replies=False),
                             self._pipe(server_r, client_w, replies=True))


@contextlib.asynccontextmanager
async def reply_dropping_relay(target_port: int) -> AsyncIterator[ReplyDroppingRelay]:
    relay = ReplyDroppingRelay(target_port)
    server = await asyncio.start_server(relay._handle, "127.0.0.1", 0)
    relay.port = server.sockets[0].getsockname()[1]
    try:
        yield relay
    finally:
        server.close()
