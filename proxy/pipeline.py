"""Runs one request through the stages and the upstream relay, and settles it exactly once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import anyio
from starlette.types import Receive, Send

from proxy.context import RequestContext
from proxy.errors import GatewayError
from proxy.stages import Stage
from proxy.stages.account import Account
from proxy.stages.forward import Forward
from proxy.telemetry.recorder import Telemetry
from proxy.web.body import ClientGone, read_body, watch_disconnect
from proxy.web.respond import send_error

__all__ = ["Pipeline", "Replay"]

Replay = Callable[[RequestContext, Send], Awaitable[None]]
"""Answers a request from `ctx.cached` instead of the backend."""


class Pipeline:
    """`auth` needs only headers, so it runs before the body is read; the rest after."""

    def __init__(
        self,
        auth: Stage,
        stages: Sequence[Stage],
        forward: Forward,
        account: Account,
        *,
        max_body_bytes: int,
        telemetry: Telemetry,
        replay: Replay | None = None,
    ) -> None:
        self._auth = auth
        self._stages = tuple(stages)
        self._forward = forward
        self._account = account
        self._max_body_bytes = max_body_bytes
        self._telemetry = telemetry
        self._replay = replay

    async def run(self, ctx: RequestContext, receive: Receive, send: Send) -> None:
        """Answer the request on `send`; errors, disconnects and successes are all settled."""
        self._telemetry.begin(ctx)
        try:
            await self._auth(ctx)
            ctx.raw_body = await read_body(receive, ctx.headers, self._max_body_bytes)
            with anyio.CancelScope() as scope:
                watcher = asyncio.create_task(watch_disconnect(receive, ctx, scope))
                try:
                    for stage in self._stages:
                        if ctx.trace is None:
                            await stage(ctx)
                        else:
                            await self._telemetry.traced(ctx, stage)
                        if ctx.cached is not None:
                            break
                    if ctx.cached is not None and self._replay is not None:
                        await self._replay(ctx, send)
                    else:
                        await self._forward(ctx, send)
                finally:
                    watcher.cancel()
        except GatewayError as exc:
            ctx.error_code = exc.code or exc.type
            if not ctx.status:
                ctx.status = exc.status
                ctx.answered = True
                await send_error(send, exc, ctx.gateway_headers())
        except ClientGone:
            ctx.client_disconnected = True
        finally:
            with anyio.CancelScope(shield=True):
                await self._account(ctx)
