"""A TCP relay in front of a server that, once told, passes on the next thing a client sends and
then drops that connection without passing back the answer: a call that ran, and whose reply was
lost with its connection (a Redis restarting under a busy gateway does this to some). Or, told
so, swallows it: a call lost on its way, that never ran."""

from __future__ import annotations

import asyncio
import threading
from types import TracebackType

# msgpack's string "charge": a quota charge's name in the stores' script call (link.py), in no
# other call (the script's own text says `op_charge`, without the length byte).
CHARGE = b"\xa6charge"
CUT_AFTER_S = 0.3  # time for the server to act on what was passed on, before the cut


class CutProxy:
    def __init__(self, target_port: int) -> None:
        self.port = 0
        self._target_port = target_port
        self._armed = threading.Event()
        self._marker, self._passed_on = b"", True
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)

    def __enter__(self) -> CutProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the relay did not start")
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def cut_next(self, marker: bytes = b"", *, passed_on: bool = True) -> None:
        """The next data any client sends (holding `marker`) is passed on, or not `passed_on`
        swallowed, then its connection dropped."""
        self._marker, self._passed_on = marker, passed_on
        self._armed.set()

    @property
    def cut(self) -> bool:
        """The cut asked for was made."""
        return not self._armed.is_set()

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stop.wait()

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self._target_port)
        doomed = False

        async def up() -> None:
            nonlocal doomed
            while data := await client_r.read(65536):
                if self._armed.is_set() and self._marker in data:
                    self._armed.clear()
                    doomed = True
                    if not self._passed_on:
                        break
                server_w.write(data)
                await server_w.drain()
                if doomed:
                    await asyncio.sleep(CUT_AFTER_S)
                    break
            client_w.transport.abort()
            server_w.transport.abort()

        async def down() -> None:
            while data := await server_r.read(65536):
                if not doomed:
                    client_w.write(data)
                    await client_w.drain()
            client_w.transport.abort()

        await asyncio.gather(up(), down(), return_exceptions=True)
