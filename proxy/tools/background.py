"""An ASGI app served by uvicorn in a background thread: for the demo and for tests, on the same
HTTP protocol as `tokenweir serve` (proxy/asgi/protocol.py)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Literal

import uvicorn
from starlette.types import ASGIApp

from proxy.asgi.protocol import protocol_with_header_timeout

__all__ = ["BackgroundServer"]


class BackgroundServer:
    """Serves `app` on `host:port` (port 0: a free one) from a daemon thread until `stop()`;
    over https with `tls`, a (certificate, key) pair of PEM files; on `http`, one of uvicorn's
    own HTTP protocols (`h11`, `httptools`), instead of `tokenweir serve`'s if given."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: tuple[Path, Path] | None = None,
        http: Literal["h11", "httptools"] | None = None,
    ) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
        except OSError:
            self._socket.close()
            raise
        self.host = host
        self.port: int = self._socket.getsockname()[1]
        config = uvicorn.Config(
            app,
            log_level="warning",
            lifespan="on",
            ws="none",
            proxy_headers=False,  # as `tokenweir serve`: the app applies them (proxy/app.py)
            http=http or protocol_with_header_timeout(10.0),
            timeout_graceful_shutdown=2,
            ssl_certfile=tls[0] if tls else None,
            ssl_keyfile=tls[1] if tls else None,
        )
        self._scheme = "https" if tls else "http"
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"{self._scheme}://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> str:
        """Start serving; returns the base URL once the server accepts connections."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.01)
        return self.url

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
        self._socket.close()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
