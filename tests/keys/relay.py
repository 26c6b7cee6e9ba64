"""A TCP relay in front of Redis that holds one runtime-key command (or its reply) until told,
so a test can make another operation land inside it: event order, not timing."""

from __future__ import annotations

import contextlib
import socket
import threading
from urllib.parse import urlsplit

__all__ = ["HeldCommand"]


class HeldCommand:
    """Holds the first command whose bytes contain `marker` once `armed` is set: the command
    itself (Redis has not run it yet) or, with `reply`, its answer (Redis has run it). The hold
    must end within the key store's 1 s timeout: release it as soon as the other side is done."""

    def __init__(self, redis_url: str, marker: bytes, *, reply: bool = False) -> None:
        self._upstream = urlsplit(redis_url)
        self._marker, self._reply = marker, reply
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self._listener.getsockname()[1]}/0"
        self.armed, self.held, self.released = (threading.Event() for _ in range(3))
        self._lock = threading.Lock()
        self._taken = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self._listener.accept()
                server = socket.create_connection((self._upstream.hostname, self._upstream.port))
                hold_reply = threading.Event()  # this connection's next reply is held
                for source, sink in ((client, server), (server, client)):
                    threading.Thread(
                        target=self._pump, args=(source, sink, source is client, hold_reply),
                        daemon=True,
                    ).start()  # fmt: skip

    def _pump(
        self,
        source: socket.socket,
        sink: socket.socket,
        outgoing: bool,
        hold_reply: threading.Event,
    ) -> None:
        with contextlib.suppress(OSError), source, sink:
            while chunk := source.recv(65536):
                if outgoing and self._marker in chunk and self._take():
                    if self._reply:
                        hold_reply.set()
                    else:
                        self._hold()
                elif not outgoing and hold_reply.is_set():
                    hold_reply.clear()
                    self._hold()
                sink.sendall(chunk)

    def _take(self) -> bool:
        with self._lock:
            taken = self.armed.is_set() and not self._taken
            self._taken = self._taken or taken
        return taken

    def _hold(self) -> None:
        self.held.set()
        self.released.wait(10)

    def close(self) -> None:
        self.released.set()
        self._listener.close()
