"""The server's listening socket: connections accepted on it send small replies at once
(TCP_NODELAY, which asyncio sets only on a socket whose protocol says TCP): without it,
each reply after the first on a kept-alive connection waited ~40 ms for a delayed ACK."""

from __future__ import annotations

import asyncio
import socket

from omnistage.entrypoints.openai.api_server import bind_listener


async def test_accepted_connections_have_nagle_off() -> None:
    accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = writer.get_extra_info("socket")
        accepted.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    listener = bind_listener("127.0.0.1", 0)
    server = await asyncio.start_server(on_connect, sock=listener)
    async with server:
        _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
        assert await asyncio.wait_for(accepted, 10) != 0
        writer.close()
