"""Raw ASGI plumbing for the mock backend: read a body, answer JSON, run the lifespan, see a
client leave. Plain functions over `receive`/`send`, with no framework objects in the hot path.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

from starlette.types import Receive, Send

from proxy.asgi.body import ClientGone, receive_all
from proxy.tools.mock.request import MockHTTPError

__all__ = [
    "JSON_HEADERS",
    "MAX_BODY_BYTES",
    "ClientGone",
    "left_within",
    "read_body",
    "respond",
    "respond_error",
    "run_lifespan",
]

MAX_BODY_BYTES: Final = 16 * 1024 * 1024
JSON_HEADERS: Final = ((b"content-type", b"application/json"),)


async def respond(
    send: Send, status: int, body: bytes, headers: tuple[tuple[bytes, bytes], ...] = JSON_HEADERS
) -> None:
    await send({"type": "http.response.start", "status": status, "headers": list(headers)})
    await send({"type": "http.response.body", "body": body})


async def respond_error(send: Send, error: MockHTTPError, *, anthropic: bool = False) -> None:
    headers: tuple[tuple[bytes, bytes], ...] = JSON_HEADERS
    if error.retry_after_s is not None:
        headers += ((b"retry-after", str(error.retry_after_s).encode()),)
    await respond(send, error.status, error.body(anthropic=anthropic), headers)


async def read_body(receive: Receive) -> bytes:
    return await receive_all(receive, MAX_BODY_BYTES, _too_large)


def _too_large(limit: int) -> MockHTTPError:
    return MockHTTPError(413, "Request body too large for the mock backend.")


async def run_lifespan(receive: Receive, send: Send) -> None:
    """Acknowledge startup and shutdown; the mock opens nothing that needs closing."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def left_within(watcher: asyncio.Future[Any], delay_s: float) -> bool:
    """Wait up to `delay_s`, returning True as soon as `watcher` (awaiting `receive()`) is done.

    Once the body is read, the next `receive()` only returns when the client disconnects.
    """
    if delay_s > 0:
        await asyncio.wait({watcher}, timeout=delay_s)
    return watcher.done()
