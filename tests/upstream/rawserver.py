"""A raw asyncio HTTP server on 127.0.0.1 for transport tests: each test writes the bytes."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable
from types import TracebackType

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    """An asyncio server on 127.0.0.1 running `handler` per connection; counts connections.
    With `tls` (tests/certs.py `server_tls`) it speaks https."""

    def __init__(self, handler: Handler, tls: ssl.SSLContext | None = None) -> None:
        self.connections = 0
        self.url = ""
        self._handler = handler
        self._tls = tls
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self._tls)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"{'https' if self._tls else 'http'}://127.0.0.1:{port}"
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.transport.abort()  # handlers waiting to read see the end and return
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2)
        await self._server.wait_closed()

    def stop_listening(self) -> None:
        """New connections are refused; those open go on."""
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.append(writer)
        try:
            await self._handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            self._tasks.discard(task)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's head, its Content-Length body consumed."""
    head = await reader.readuntil(b"\r\n\r\n")
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            await reader.readexactly(int(line.split(b":")[1]))
    return head
