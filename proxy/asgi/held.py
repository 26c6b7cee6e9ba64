"""An answer's head held back until its first body bytes are sent, to go out with them in one
write.

uvicorn writes a response's head to the connection as soon as the app sends
`http.response.start`, and its body on the next `send`: two writes (two system calls, two TCP
segments for the client to read) where one would do, of about 14 µs of the gateway's CPU each
(docs/benchmarks.md, "One write a whole answer"). A whole answer goes out in one write; a
stream's head goes out with its first chunk (the gateway starts a stream only once that chunk
is in hand), and its later chunks as they come. Under `tokenweir serve` the request's scope
carries its response cycle (proxy/asgi/direct.py), and the fast lane's one `send` wrapper
(proxy/web/requestid.py `IdSender`) holds it from the start message to the first body message,
whatever the answer: a whole one, a stream, an error, a refusal at auth. While held, the
cycle's transport is a stand-in that keeps what uvicorn writes, and `release` writes it as one
and gives the cycle its transport back. uvicorn's `send` writes through `cycle.transport` and
may close it; a close writes what was held first, so the bytes and their order are uvicorn's.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from proxy.asgi.direct import LentCycle

__all__ = ["HeldHead", "hold_head"]


def hold_head(lent: LentCycle | None) -> HeldHead | None:
    """Hold the writes of the request's cycle from now (its head is about to be sent) until
    `release`. None where the server lent no cycle."""
    cycle = None if lent is None else lent()
    return None if cycle is None else HeldHead(cycle)


class HeldHead(asyncio.Transport):
    """The cycle's transport while held: keeps writes, passes the rest on."""

    __slots__ = ("_parts", "_transport", "cycle")

    def __init__(self, cycle: RequestResponseCycle) -> None:  # no super(): nothing of its own
        self.cycle = cycle
        self._transport = cycle.transport
        self._parts: list[bytes] = []
        cycle.transport = self

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._parts.append(bytes(data))

    def release(self) -> None:
        """Write what was held, as one, unless the connection is closing; the cycle writes to
        its own transport from now on."""
        if self.cycle.transport is self:
            self.cycle.transport = self._transport
        parts, self._parts = self._parts, []
        if parts and not self._transport.is_closing():
            self._transport.write(parts[0] if len(parts) == 1 else b"".join(parts))

    def close(self) -> None:
        self.release()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()
