"""Run real ASGI servers on 127.0.0.1 for tests: uvicorn in a background thread, free port."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

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
