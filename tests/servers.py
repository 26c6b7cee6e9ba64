"""Run real ASGI servers on 127.0.0.1 for tests: uvicorn in a background thread, free port."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from starlette.types import ASGIApp

from proxy.tools.background import BackgroundServer


@contextmanager
def serve(app: ASGIApp, *, start_timeout_s: float = 10.0) -> Iterator[str]:
    """Serve `app` on a free 127.0.0.1 port; yields its base URL, e.g. ``http://127.0.0.1:41234``."""
    server = BackgroundServer(app)
    try:
        yield server.start(start_timeout_s)
    finally:
        server.stop()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """Wait until a gateway started as `process` answers `GET /healthz`; fail if it exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/healthz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        if process.poll() is not None:
            stderr = process.stderr.read().decode(errors="replace") if process.stderr else ""
            raise AssertionError(f"the gateway exited: {stderr[-2000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} did not become healthy")
        time.sleep(0.05)
