"""Cutting off a client that reads nothing of what is written to it (a stalled client)."""

from __future__ import annotations

import asyncio
import contextlib
import sys

if sys.platform != "win32":  # the kernel's send queue; on Windows the transport's buffer alone
    from fcntl import ioctl
    from termios import TIOCOUTQ

__all__ = ["StallWatch"]


class StallWatch:
    """Armed when the client's socket is full (its transport paused the protocol's writing),
    disarmed when it takes writes again. If over the stall timeout the client read none of
    what waits for it, the connection is aborted, what is buffered for it with it: a stream
    held a backend and a slot, and a whole answer the gateway's memory (up to 32 MiB a
    connection: a close waits for the client to read), for as long as the client read nothing.
    A client that read some (what waits for it, in the transport's buffer and the socket's send
    queue, shrank) is slow, not stalled: it gets another timeout (a whole answer drains below
    the transport's low-water mark only at its end)."""

    __slots__ = ("_left", "_loop", "_timeout_s", "_timer")

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self._loop = loop
        self._timeout_s = timeout_s
        self._timer: asyncio.TimerHandle | None = None
        self._left = 0

    def paused(self, transport: asyncio.Transport) -> None:
        if self._timer is None:
            self._left = _waiting_bytes(transport)
            self._timer = self._loop.call_later(self._timeout_s, self._check, transport)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self, transport: asyncio.Transport) -> None:
        self._timer = None
        buffered = transport.get_write_buffer_size()
        if buffered and _waiting_bytes(transport) < self._left:  # it read some since
            self.paused(transport)
        elif buffered or not transport.is_closing():
            transport.abort()


def _waiting_bytes(transport: asyncio.Transport) -> int:
    """What was written for the client and not yet taken by it: the transport's buffer and,
    where the kernel says, the socket's send queue (a few MiB: a slow reader empties it first)."""
    waiting = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sys.platform != "win32" and sock is not None:
        with contextlib.suppress(OSError, ValueError):
            queued = ioctl(sock.fileno(), TIOCOUTQ, b"\0\0\0\0")
            waiting += int.from_bytes(queued, sys.byteorder)
    return waiting
