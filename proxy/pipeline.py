"""Runs one request through the stages and the upstream relay, and settles it exactly once.

Writes status for a request that ended without one: 499 (client gone) or 500 (internal error).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from functools import partial

from starlette.types import Message, Receive, Send

from proxy.asgi.body import ClientGone, client_left, read_body, watch_disconnect
from proxy.asgi.direct import body_arrived, cut_off_stalled
from proxy.asgi.drain import Drain
from proxy.asgi.protocol import watch_client
from proxy.asgi.respond import send_error
from proxy.clock import Clock
from proxy.context import Admitted, Outcome, RequestContext
from proxy.errors import GatewayError, InsufficientQuota, RateLimited, ShuttingDown
from proxy.stages import Authenticator, Stage
from proxy.stages.account import Account
from proxy.stages.degrade import name_reserving_rule
from proxy.stages.forward import Forward
from proxy.telemetry.recorder import Telemetry
from proxy.tokens.segments import counting_for, done_counting

__all__ = ["Pipeline", "Replay"]

Replay = Callable[[Admitted, Send], Awaitable[None]]
"""Answers a request from `ctx.cached` instead of the backend."""


class Pipeline:
    """`auth` needs only headers, so it runs before the body is read; the rest after."""

    def __init__(
        self,
        auth: Authenticator,
        stages: Sequence[Stage],
        forward: Forward,
        account: Account,
        *,
        clock: Clock,
        max_body_bytes: int,
        telemetry: Telemetry,
        replay: Replay | None = None,
        body_timeout_s: float | None = None,
        drain: Drain | None = None,
    ) -> None:
        self._auth = auth
        # Only the stages that may get a span of their own are timed for the trace.
        self._stages = tuple(zip(stages, telemetry.timed_stages(stages), strict=True))
        self._forward = forward
        self._account = account
        self._clock = clock
        self._max_body_bytes = max_body_bytes
        self._telemetry = telemetry
        self._replay = replay
        self._body_timeout_s = body_timeout_s
        self.drain = drain or Drain(0.0)

    @property
    def account(self) -> Account:
        """What settles and records each request (and logs the ones answered without it)."""
        return self._account

    @property
    def stages(self) -> tuple[Stage, ...]:
        """The stages after auth, in order."""
        return tuple(stage for stage, _ in self._stages)

    async def run(self, arrival: RequestContext, receive: Receive, send: Send) -> None:
        """Answer the request on `send`; errors, disconnects and successes are all settled."""
        self._telemetry.begin(arrival)
        ctx = arrival  # until auth admits it
        counting = None
        try:
            ctx = admitted = await self._auth(arrival)
            counting = counting_for(admitted.tenant_name)  # its token counts are remembered
            send = self._releasing_before_the_end(admitted, send)
            scope = admitted.scope
            # Tracked from its body's read on: a client still sending one when the drain ends
            # gets its 503 then, not the server's cancel of the task at its own later timeout.
            with scope, self.drain.track(scope):
                ctx.raw_body = await self._read_body(ctx, receive)
                # The client's leaving cancels the scope: told by the connection itself under
                # `tokenweir serve`, else seen by a task waiting on `receive`.
                gone = partial(client_left, ctx.outcome, scope)
                connection = watch_client(ctx.server_cycle, gone)
                watcher = None
                if connection is None:
                    watcher = asyncio.create_task(watch_disconnect(receive, ctx, scope))
                try:
                    await self._answer(admitted, send)
                finally:
                    if connection is not None:
                        connection.unwatch(gone)
                    if watcher is not None:
                        watcher.cancel()
            if self.drain.was_cut(scope):
                await _end_cut(ctx, send)
        except GatewayError as exc:
            code = exc.code or exc.type
            if ctx.status:  # a stream broke off: its error event is sent already
                ctx.outcome.error_code = code
            else:
                if isinstance(ctx, Admitted) and _refused_tokens(exc):
                    name_reserving_rule(ctx)
                ctx.outcome.refused(exc.status, code)
                await send_error(send, exc, ctx.gateway_headers())
        except ClientGone:
            ctx.outcome.client_disconnected = True
        finally:
            if not ctx.status:
                _record_unanswered(ctx.outcome)
            try:
                await self._account(ctx)  # past the request's scope: nothing of it cancels this
            finally:
                if counting is not None:
                    done_counting(counting)

    async def _read_body(self, ctx: Admitted, receive: Receive) -> bytes:
        """The request's body; the time spent waiting for the rest of it to arrive is the
        client's, not the gateway's own (a slow upload read as seconds of gateway overhead)."""
        arrived = body_arrived(ctx.server_cycle)
        began_s = 0.0 if arrived else self._clock.monotonic()
        raw = await read_body(
            receive, ctx.headers, self._max_body_bytes, self._body_timeout_s, arrived=arrived
        )
        if not arrived:
            ctx.meter.waited(self._clock.monotonic() - began_s)
        return raw

    async def _answer(self, ctx: Admitted, send: Send) -> None:
        for stage, timed in self._stages:
            if timed is not None and ctx.trace is not None:
                await self._telemetry.traced(ctx, timed)
            else:
                await stage(ctx)
            if ctx.cached is not None:
                break
        if ctx.cached is not None and self._replay is not None:
            await self._replay(ctx, send)
        else:
            await self._forward(ctx, send)

    def _releasing_before_the_end(self, ctx: Admitted, send: Send) -> Send:
        """`send`, but the request's holds are settled before its answer's last byte goes out."""
        release = self._account.release

        async def releasing(message: Message) -> None:
            # Per chunk, one lookup: a chunk has more_body, the start message has no body.
            if not message.get("more_body", False) and message["type"] == "http.response.body":
                with ctx.scope.shielded():
                    await release(ctx)
                reshow = ctx.outcome.reshow  # the usage billed, where the backend's was not
                if reshow is not None:
                    message = {**message, "body": reshow(ctx, message.get("body", b""))}
            await send(message)

        return releasing


def _refused_tokens(exc: GatewayError) -> bool:
    """A quota's or rate limit's 429 on the tokens (or money) reserved, not on a request count
    or a slot: a degradation rule's bound or model may have changed what it refused."""
    if isinstance(exc, RateLimited):
        return exc.on_tokens
    return isinstance(exc, InsufficientQuota)


def _record_unanswered(outcome: Outcome) -> None:
    """A request that ended with no status sent: the client left first (499, as nginx logs
    it), or an unexpected error escaped the stages (500: the outermost handler answers it)."""
    if outcome.client_disconnected:
        outcome.status, outcome.error_code = 499, outcome.error_code or "client_closed"
    else:
        outcome.status, outcome.error_code = 500, outcome.error_code or "internal_error"


async def _end_cut(ctx: RequestContext, send: Send) -> None:
    """The drain timeout ended this request: a 503 if nothing was sent yet, else (on a stream)
    an OpenAI-shaped error event and no [DONE], so the client cannot take it as complete (a
    client reading nothing has its connection dropped instead)."""
    error = ShuttingDown("The gateway is shutting down; retry the request.", retry_after_s=1)
    if ctx.outcome.answered:
        return
    if not ctx.status:
        raise error
    ctx.outcome.error_code, ctx.outcome.answered = error.code, True  # the status sent stays
    if cut_off_stalled(ctx.server_cycle):
        # A client reading nothing would not read the error event either: waiting to write it
        # held the process past the drain, until the server cancelled the request.
        return
    ending = b"data: " + error.to_json() + b"\n\n" if ctx.stream else b""
    await send({"type": "http.response.body", "body": ending, "more_body": False})
