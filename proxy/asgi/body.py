"""Reading a request body within the size cap and time limit; noticing when the client goes away."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from starlette.types import Receive

from proxy.asgi.cancel import RequestScope
from proxy.context import Outcome, RequestContext
from proxy.errors import BadRequest, BodyTooLarge, RequestTimeout

__all__ = ["ClientGone", "client_left", "read_body", "receive_all", "watch_disconnect"]


class ClientGone(Exception):
    """The client hung up before the request body arrived."""


async def read_body(
    receive: Receive,
    headers: Mapping[str, str],
    limit: int,
    timeout_s: float | None = None,
    *,
    arrived: bool = False,
) -> bytes:
    """The whole body; 413 past `limit` bytes, 408 if it has not all arrived within `timeout_s`.
    `arrived`: the server holds it whole already (proxy.asgi.direct.body_arrived), so `receive`
    cannot wait and no timer is set (one made and cancelled per request costs a few µs)."""
    declared = headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise BadRequest("Invalid Content-Length header.")
        if int(declared) > limit:
            raise _too_large(limit)
    if arrived:
        return await receive_all(receive, limit, _too_large)
    # asyncio's own timeout: no cancel scope is open yet, and anyio's costs several times more.
    try:
        async with asyncio.timeout(timeout_s):
            return await receive_all(receive, limit, _too_large)
    except TimeoutError:
        raise RequestTimeout(f"The request body did not arrive within {timeout_s} s.") from None


async def receive_all(receive: Receive, limit: int, too_large: Callable[[int], Exception]) -> bytes:
    """Every chunk of the body; `too_large(limit)` is raised past `limit` bytes, ClientGone if
    the client leaves first."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def watch_disconnect(receive: Receive, ctx: RequestContext, scope: RequestScope) -> None:
    """Cancel `scope` (the upstream call with it) the moment the client disconnects."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            client_left(ctx.outcome, scope)
            return


def client_left(outcome: Outcome, scope: RequestScope) -> None:
    """The client left: unless its answer is complete, the request is cancelled and says why."""
    if not outcome.answered:
        outcome.client_disconnected = True
        scope.cancel()


def _too_large(limit: int) -> BodyTooLarge:
    return BodyTooLarge(f"The request body is larger than this gateway accepts ({limit} bytes).")
