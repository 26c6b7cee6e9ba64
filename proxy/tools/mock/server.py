"""Serve `tokenweir mock-backend` (backend.py's app) on uvloop and httptools."""

from __future__ import annotations

import asyncio

import uvicorn
from starlette.types import ASGIApp

from proxy.tools.mock.backend import create_app

__all__ = ["run", "serve"]


def _config(app: ASGIApp, host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        ws="none",
        lifespan="on",
        access_log=False,
        timeout_graceful_shutdown=2,
    )


async def serve(*, host: str, port: int, ttft_ms: float, tokens_per_second: float) -> None:
    """Serve the mock on the running loop until cancelled, then shut down gracefully."""
    app = create_app(ttft_ms=ttft_ms, tokens_per_second=tokens_per_second)
    server = uvicorn.Server(_config(app, host, port))
    task = asyncio.ensure_future(server.serve())
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        server.should_exit = True
        await task
        raise


def run(
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    ttft_ms: float = 0.0,
    tokens_per_second: float = 750.0,
    load_ttft_ms: float = 0.0,
    prefill_ms_per_1k_tokens: float = 0.0,
    prefix_cache: int = 0,
) -> None:
    """Serve the mock in the foreground on uvloop and httptools until interrupted."""
    app = create_app(
        ttft_ms=ttft_ms,
        tokens_per_second=tokens_per_second,
        load_ttft_ms=load_ttft_ms,
        prefill_ms_per_1k_tokens=prefill_ms_per_1k_tokens,
        prefix_cache=prefix_cache,
    )
    uvicorn.Server(_config(app, host, port)).run()
