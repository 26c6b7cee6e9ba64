"""A request's tries at its model's backends, before the first byte of an answer: choose one,
admit the request on that backend's own limits, open the call, and on a failure (a connect
error, a 5xx) or a full backend move to the next, at most the pool's `max_attempts` in all; a
backend that failed gives back what the request held on its limits before the next is tried.
The gateway's own connection pool being full is no backend's failure and is not retried.

Writes backend, route (the backend held in flight, for settling) and, on a fallback, model
(and its input, recounted with its tokenizer before it is sent: `Recount`).
`settle` feeds the backend's health with the outcome, TTFT and tokens/s.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import httpx

from proxy.clock import Clock
from proxy.context import Admitted
from proxy.errors import UpstreamError, UpstreamTimeout, UpstreamUnavailable
from proxy.holds import Routed
from proxy.policy.model import Backend
from proxy.routing.health import BackendHealth
from proxy.routing.pool import Pools
from proxy.upstream.client import (
    CONNECT_TIMEOUT_CODE,
    ConnectionsBusy,
    UpstreamClient,
    UpstreamRejected,
)

__all__ = ["Admit", "Attempts", "GiveBack", "Recount"]

Admit = Callable[[Admitted, Backend], Awaitable[int | None]]
"""The chosen backend's own limits (RateLimits.admit_backend); raises UpstreamUnavailable if
the backend is full, else returns its requests in flight across replicas (None: not counted)."""
GiveBack = Callable[[Admitted, Backend], Awaitable[None]]
"""What a backend that failed holds on its own limits, given back as the request moves on
(RateLimits.give_back_backend)."""
Recount = Callable[[Admitted, str], Awaitable[None]]
"""The input counted again for the fallback model the request was just sent to, from the model
named (proxy.stages.recount); raises a GatewayError if it does not fit there."""


class Attempts:
    def __init__(
        self,
        pools: Pools,
        upstream: UpstreamClient,
        clock: Clock,
        admit: Admit | None = None,
        give_back: GiveBack | None = None,
        recount: Recount | None = None,
    ) -> None:
        self._pools = pools
        self._upstream = upstream
        self._clock = clock
        self._admit = admit
        self._give_back = give_back
        self._recount = recount

    async def begin(self, ctx: Admitted) -> Routed:
        """Hold the first backend that is available and admits the request; a 503 if none."""
        home = ctx.model
        health = await self._choose(ctx, home, ())
        if health is None:
            raise self._unavailable(home)
        routed = ctx.route = Routed(home, health)
        self._take(ctx, routed, health)
        full = await self._refusal(ctx, routed)
        if full is not None and not await self._fail_over(ctx, routed):
            raise full
        return routed

    async def open(
        self, ctx: Admitted, body: dict[str, Any], extra_headers: Mapping[str, str] = {}
    ) -> tuple[Backend, httpx.Response]:
        """Open the upstream call; a failure before the first byte moves to another backend.
        A request the Route stage did not hold a backend for is routed here first."""
        routed = ctx.route or await self.begin(ctx)
        while True:
            routed.attempt_s = self._clock.monotonic()
            ctx.meter.attempting(routed.attempt_s)
            routed.sent = False
            try:
                backend = routed.health.backend
                response = await self._upstream.open(ctx, backend, body, extra_headers)
            except ConnectionsBusy:
                # The gateway's own pool is full: no mark on a backend that heard nothing, and
                # no other backend to try, as they share the pool.
                raise
            except UpstreamRejected as exc:
                if exc.status != 429:
                    raise
                # The backend is full, not broken: held back for its Retry-After and the
                # request sent to another, or its 429 passed on when none is left.
                routed.health.limited(self._clock.monotonic(), exc.retry_after_s)
                routed.tried.append(routed.health.name)
                if not await self._move_on(ctx, routed, backend):
                    raise
            except UpstreamError as exc:
                routed.health.failed(self._clock.monotonic())
                routed.tried.append(routed.health.name)
                if not _retryable(exc) or not await self._move_on(ctx, routed, backend):
                    raise
            else:
                routed.opened = True
                if not ctx.stream:  # a whole answer's head comes with it (a stream's, before any)
                    routed.health.circuit.answering()
                return backend, response
            if body.get("model") != ctx.model:
                body = _for_fallback(body, ctx.body)

    async def _move_on(self, ctx: Admitted, routed: Routed, backend: Backend) -> bool:
        """Give back what the request holds on `backend`'s limits and hold the next backend;
        False if none is left."""
        if self._give_back is not None:
            await self._give_back(ctx, backend)
        return await self._fail_over(ctx, routed)

    def holding(self, ctx: Admitted) -> bool:
        return ctx.route is not None

    async def settle(self, ctx: Admitted) -> None:
        """Release the backend and record how it served; runs once, in `finally`."""
        routed, ctx.route = ctx.route, None
        if routed is None:
            return
        health = routed.health
        health.left(ctx.meter, routed.counted)
        if not routed.opened:
            if health.name not in routed.tried:
                health.circuit.abandoned()
            return
        now = self._clock.monotonic()
        if ctx.outcome.completed:
            health.circuit.succeeded()
        elif ctx.outcome.client_disconnected or _held_up_by_client(ctx):
            health.circuit.abandoned()  # no verdict: a trial may be tried again
        else:
            health.failed(now)  # it broke off mid-answer, or sent no event in time
            return
        meter = ctx.meter
        first_s = meter.upstream_first_byte_s
        ttft_s = None if first_s is None or not ctx.stream else first_s - routed.attempt_s
        health.served(now, ttft_s, meter.tokens_per_s(ctx.output_tokens or 0, ctx.choices))

    async def _fail_over(self, ctx: Admitted, routed: Routed) -> bool:
        """Move the request to the next backend that admits it; False if none is left. A full
        backend passed over is no attempt: `max_attempts` bounds the backends sent the request."""
        max_attempts = self._pools.pool(routed.home).spec.max_attempts
        while len(routed.tried) - routed.passed < max_attempts:
            health = await self._choose(ctx, routed.home, routed.tried)
            if health is None:
                return False
            self._take(ctx, routed, health)
            if await self._refusal(ctx, routed) is None:
                return True
        return False

    async def _refusal(self, ctx: Admitted, routed: Routed) -> UpstreamUnavailable | None:
        """Admit the request on the held backend's limits: None, or why it is full (the
        backend is then tried, with no mark on its health: full is not failed)."""
        if self._admit is None:
            return None
        try:
            inflight = await self._admit(ctx, routed.health.backend)
        except UpstreamUnavailable as full:
            routed.tried.append(routed.health.name)
            routed.passed += 1
            routed.health.circuit.abandoned()
            return full
        if inflight is not None:
            routed.health.counted(inflight, self._clock.monotonic())
            routed.counted = True
        return None

    async def _choose(self, ctx: Admitted, home: str, tried: Sequence[str]) -> BackendHealth | None:
        now = self._clock.monotonic()
        for pool in self._pools.chain(home):
            candidates = [h for h in pool.available(now) if h.name not in tried]
            if len(candidates) > 1:  # one that answered 429 lately is the last choice
                candidates = [h for h in candidates if h.limited_until_s <= now] or candidates
            if candidates:
                if pool.name != ctx.model:
                    sent_to = ctx.model
                    ctx.outgoing.set_model(pool.name)
                    if self._recount is not None:  # before its limits count the input
                        await self._recount(ctx, sent_to)
                return pool.strategy.order(candidates, ctx)[0]
        return None

    def _take(self, ctx: Admitted, routed: Routed, health: BackendHealth) -> None:
        routed.health.left(ctx.meter, routed.counted)
        routed.counted = False
        routed.health = health
        health.active.add(ctx.meter)
        health.circuit.picked(self._clock.monotonic())
        ctx.backend = health.backend

    def _unavailable(self, model: str) -> UpstreamUnavailable:
        return UpstreamUnavailable(
            f"No backend for model {model!r} is available (circuits open or probes failing); "
            "try again shortly.",
            retry_after_s=self._pools.retry_after_s(model),
        )


def _for_fallback(sent: dict[str, Any], shaped: Mapping[str, Any]) -> dict[str, Any]:
    """The body sent again to a fallback model: its name, and the messages as shaping left them
    for it (its own count may have trimmed them)."""
    body = {**sent, "model": shaped["model"]}
    if "messages" in shaped:
        body["messages"] = shaped["messages"]
    return body


def _retryable(exc: UpstreamError) -> bool:
    """Connect errors and 5xx; a read or first-byte timeout is not retried (the backend may be
    generating, and a retry would double its work)."""
    return not isinstance(exc, UpstreamTimeout) or exc.code == CONNECT_TIMEOUT_CODE


def _held_up_by_client(ctx: Admitted) -> bool:
    """A stream cut at a deadline after its relay waited for its client to read: the gateway
    pushed back on the backend meanwhile, so the time was the client's, not the backend's (a
    tenant's slow readers opened a healthy backend's circuit for every tenant)."""
    return ctx.outcome.error_code == UpstreamTimeout.code and ctx.meter.client_slow_s > 0
