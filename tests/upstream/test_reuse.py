"""A kept-alive backend connection is reused only when nothing is waiting on it: bytes a backend
sends after an answer, nobody having asked, never become the next request's answer."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from proxy.upstream.transport import PooledTransport
from tests.upstream.loops import anyio_backend  # noqa: F401 (the fixture)

FOR_A = b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\ntenant-A"
A_AGAIN = b"HTTP/1.1 200 OK\r\nContent-Length: 15\r\n\r\ntenant-A secret"
FOR_B = b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\ntenant-B"


class LateDuplicate:
    """A blocking server on a thread of its own (so it sends while the test's loop is held):
    its first connection answers A's request, then, once told, sends A's answer again unasked;
    every later connection answers B. `connections` counts them."""

    def __init__(self) -> None:
        self.connections = 0
        self.stopping = False
        self.send_again = threading.Event()
        self.sent_again = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(10)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}/"
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        with self._listener:
            while True:
                try:
                    connection, _ = self._listener.accept()
                except OSError:
                    return
                if self.stopping:
                    connection.close()
                    return
                self.connections += 1
                with connection:
                    self._answer(connection, first=self.connections == 1)

    def _answer(self, connection: socket.socket, *, first: bool) -> None:
        connection.settimeout(10)
        try:
            connection.recv(65536)
            if not first:
                connection.sendall(FOR_B)
                return
            connection.sendall(FOR_A)
            self.send_again.wait(10)
            connection.sendall(A_AGAIN)
            self.sent_again.set()
            while connection.recv(65536):  # the request that would take those bytes, if any
                pass
        except OSError:
            pass

    @contextmanager
    def running(self) -> Iterator[LateDuplicate]:
        self._thread.start()
        try:
            yield self
        finally:
            self.stopping = True
            self.send_again.set()
            with contextlib.suppress(OSError):  # wakes the accept
                socket.create_connection(self._listener.getsockname(), timeout=5).close()
            self._thread.join(10)


@pytest.mark.anyio
async def test_bytes_waiting_on_an_idle_connection_are_not_the_next_answer() -> None:
    """The backend repeats A's answer while the gateway's loop is busy elsewhere (held here by
    a blocking wait), so the bytes sit unread in the socket when B's request takes the idle
    connection. B got A's answer, as its own; now that connection is dropped unused and B's
    request goes out on a new one."""
    transport = PooledTransport(
        connect_timeout_s=5.0,
        read_timeout_s=5.0,
        write_timeout_s=5.0,
        pool_timeout_s=5.0,
        max_connections=4,
    )
    with LateDuplicate().running() as backend:
        async with httpx.AsyncClient(transport=transport, timeout=5.0) as client:
            assert (await client.post(backend.url, content=b"A")).content == b"tenant-A"
            backend.send_again.set()
            assert backend.sent_again.wait(10)
            # Blocking on purpose: the loop cannot read them; loopback delivers them at once.
            time.sleep(0.2)  # noqa: ASYNC251
            answer = await client.post(backend.url, content=b"B")
    assert answer.content == b"tenant-B"
    assert backend.connections == 2
