"""Rate limits: requests and tokens per minute as token buckets, max_concurrent as leased slots.

Writes rate_limit (what was charged and held, for settling) and the x-ratelimit-* headers.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

from proxy.clock import Clock
from proxy.context import Admitted
from proxy.errors import MINUTE_S, RateLimited, UpstreamUnavailable
from proxy.holds import RateLimitHold
from proxy.keys.record import KeyRecord
from proxy.leases import LeaseIds, Renewals
from proxy.policy.model import Backend, Limits, Policy
from proxy.stages.limitheaders import format_reset, rate_limit_headers, tighter
from proxy.stages.limitrefusal import limit_refusal, refused_unsent
from proxy.stages.limitshape import LimitShape, LimitShapes, limit_key, per_minute, sized_now
from proxy.stages.prefetch import Plan, taken
from proxy.stages.storagepolicy import StorageFailures
from proxy.stages.trueups import MissedTrueUps, TrueUp
from proxy.storage import scopes
from proxy.storage.base import StorageError
from proxy.storage.joint import Admit
from proxy.storage.limits import Admission, Bucket, LimitStore
from proxy.storage.scopes import tenant_scope

__all__ = [
    "LimitPlan",
    "RateLimits",
    "format_reset",
]

_log = logging.getLogger("tokenweir.ratelimit")
_QUEUE_POLL_S = 0.05


@dataclass(slots=True)
class LimitPlan:
    """An admission to ask for the request as it stands."""

    hold: RateLimitHold
    shape: LimitShape
    costs: list[int]
    step: Admit

    @property
    def steps(self) -> tuple[Admit]:
        return (self.step,)


class RateLimits:
    span_name: ClassVar[str] = "tokenweir.rate_limit.admit"
    given_back_at_settle: ClassVar[bool] = True

    def __init__(
        self,
        store: LimitStore,
        clock: Clock,
        failures: StorageFailures,
        serving: Callable[[], Policy | None] = lambda: None,  # the policy now, sizing the limits
    ) -> None:
        self._store = store
        self._serving = serving
        self._failures = failures
        self._clock = clock
        self._queues: dict[str, deque[asyncio.Future[None]]] = {}
        self._lease_ids = LeaseIds()
        self._renewals = Renewals(clock, _log, "a concurrency lease")
        self._shapes = LimitShapes()
        self.true_ups = MissedTrueUps(store, clock.wall)  # those storage did not take

    def touched(self, ctx: Admitted) -> bool:
        """The tenant has limits: the stage admitted the request against them in storage."""
        limits = ctx.tenant.limits
        return bool(
            limits.requests_per_minute
            or limits.tokens_per_minute
            or limits.max_concurrent
            or limits.per_model
        )

    async def __call__(self, ctx: Admitted) -> None:
        ctx.limited_model = ctx.model
        plan = taken(ctx, LimitPlan) or self.plan(ctx)
        if plan is None:
            return
        limits = ctx.tenant.limits
        prefetched = plan.step.taken  # the prefetch undoes what a timed-out step took
        try:
            admission = await self._admit(ctx, plan, limits)
        except StorageError as exc:
            if not prefetched or exc is not plan.step.error:
                self._undo_later(exc, plan.hold)
            self._failures.decide("rate_limit", limits, exc)
            return
        headers = rate_limit_headers(plan.shape.counts_tokens, admission.buckets)
        shown = ctx.rate_limit_headers  # a runtime key's own, if it has limits
        ctx.rate_limit_headers = tighter(shown, headers) if shown else headers
        if not admission.admitted:
            raise limit_refusal(plan.shape, plan.costs, admission)
        self._hold(ctx, plan.hold, plan.shape, plan.costs)

    def plan(self, ctx: Admitted) -> LimitPlan | None:
        """The tenant's buckets and slot pools (and its limits on this model); None without."""
        limits = ctx.tenant.limits
        shape = self._shapes.of(tenant_scope(ctx.tenant_name), limits, ctx.model)
        if shape.empty:
            return None
        costs = shape.costs(_token_cost(ctx))
        hold = RateLimitHold(shape.scope, self._lease_ids.next(), limits.lease_ttl, shape.slots)
        return LimitPlan(hold, shape, costs, self._step(hold, shape.buckets, costs))

    def replan(self, ctx: Admitted, plan: Plan) -> bool:
        return False

    async def show(self, ctx: Admitted) -> None:
        """The tenant's x-ratelimit-* headers as its buckets stand, charging nothing, for a
        request refused before this stage admitted it (a quota's 429): every answer has them."""
        shape = self._shapes.of(tenant_scope(ctx.tenant_name), ctx.tenant.limits, ctx.model)
        if not shape.buckets:
            return
        try:
            states = await self._store.peek(shape.scope, shape.buckets, now=self._clock.wall())
        except StorageError as exc:
            _log.debug("could not read the rate limits of %s: %s", ctx.tenant_name, exc)
            return
        headers = rate_limit_headers(shape.counts_tokens, states)
        shown = ctx.rate_limit_headers  # a runtime key's own, if it has limits
        ctx.rate_limit_headers = tighter(shown, headers) if shown else headers

    async def admit_backend(self, ctx: Admitted, backend: Backend) -> int | None:
        """The chosen backend's own limits, shared by every tenant: a full backend is a 503.
        First, the limits of the model it serves if a rule or a fallback changed it. Returns
        the backend's requests in flight across every replica, this one included, as its
        `max_concurrent` pool counted them (None: it has none, or storage did not answer)."""
        await self._admit_served_model(ctx)
        shape = self._shapes.of(scopes.backend_scope(backend.name), backend.limits, "")
        if shape.empty:
            return None
        costs = shape.costs(_token_cost(ctx))
        admission = await self._admit_once(ctx, shape, costs)
        if admission is None:
            return None
        if admission.admitted:
            return admission.held[0] + 1 if admission.held else None
        # The backend's own limits, which every key shares: not "this key"'s
        refusal = limit_refusal(shape, costs, admission, holder="the backend, shared by every key")
        if refusal.should_retry is False:  # larger than a per-minute limit of the backend
            raise UpstreamUnavailable(
                f"Backend {backend.name!r} cannot take this request: {refusal.message}",
                retry_after_s=MINUTE_S,
                should_retry=False,
            )
        raise UpstreamUnavailable(
            f"Backend {backend.name!r} is at capacity: {refusal.message}",
            retry_after_s=refusal.retry_after_s or 1.0,
        )

    async def _admit_served_model(self, ctx: Admitted) -> None:
        """A degradation rule or a fallback sent the request to another model after the stage
        admitted it: its limits on the model asked for (`per_model`) give back what they took
        (that model does not serve it), and its limits on the served model admit it, waiting
        in line with `queue_timeout` as the stage does, or it is a 429."""
        model, limits, asked = ctx.model, ctx.tenant.limits, ctx.limited_model
        if asked in (None, model):
            return
        ctx.limited_model = model
        scope = tenant_scope(ctx.tenant_name)
        if asked in limits.per_model:
            parts = [hold.part_on(asked) for hold in ctx.rate_limits if hold.scope == scope]
            with ctx.scope.shielded():
                await self._given_back(ctx.tenant_name, parts, 0, refused=True)
        if model not in limits.per_model:
            return
        shape = self._shapes.of_model(scope, limits, model)
        costs = shape.costs(_token_cost(ctx))
        hold = RateLimitHold(scope, self._lease_ids.next(), limits.lease_ttl, shape.slots)
        plan = LimitPlan(hold, shape, costs, self._step(hold, shape.buckets, costs))
        try:
            admission = await self._admit(ctx, plan, limits)
        except StorageError as exc:
            self._undo_later(exc, hold)
            self._failures.decide("rate_limit", limits, exc)
            return
        more = rate_limit_headers(shape.counts_tokens, admission.buckets)
        ctx.rate_limit_headers = tighter(ctx.rate_limit_headers, more)
        if not admission.admitted:
            raise limit_refusal(shape, costs, admission)
        self._hold(ctx, hold, shape, costs)

    async def _admit_once(
        self, ctx: Admitted, shape: LimitShape, costs: list[int]
    ) -> Admission | None:
        """Admit on `shape` without waiting in line; held on the request if admitted. None
        when storage failed and the tenant's policy let the request in."""
        limits = ctx.tenant.limits
        hold = RateLimitHold(shape.scope, self._lease_ids.next(), limits.lease_ttl, shape.slots)
        try:
            with ctx.scope.shielded():  # as Prefetch: what the call takes is then settled
                admission = await self._try(hold, shape.buckets, costs)
        except StorageError as exc:
            self._undo_later(exc, hold)
            self._failures.decide("rate_limit", limits, exc)
            return None
        if admission.admitted:
            self._hold(ctx, hold, shape, costs)
        return admission

    async def admit_count(self, ctx: Admitted, key: KeyRecord | None = None) -> None:
        """A token count (`POST /v1/messages/count_tokens`) takes one request from the tenant's
        requests_per_minute, and from a runtime `key`'s own, as Anthropic limits its counts: it
        calls no backend, but each costs the gateway a tokenization of up to `max_body_bytes`.
        Nothing else is charged or held. Writes the x-ratelimit-*-requests headers."""
        limits = ctx.tenant.limits
        scope = tenant_scope(ctx.tenant_name)
        buckets = [bucket for bucket, _ in per_minute(scope, limits.requests_per_minute, None, 0)]
        if key is not None:
            own = key.allowance.requests_per_minute
            buckets += [bucket for bucket, _ in per_minute(key.scope, own, None, 0)]
        if not buckets:
            return
        hold = RateLimitHold(scope, self._lease_ids.next(), limits.lease_ttl, ())
        try:
            admission = await self._try(hold, buckets, [1] * len(buckets))
        except StorageError as exc:
            self._failures.decide("rate_limit", limits, exc)
            return
        ctx.rate_limit_headers = rate_limit_headers([False] * len(buckets), admission.buckets)
        if not admission.admitted:
            refused = buckets[admission.refused or 0]
            whose = "this key" if limit_key(refused).scope == scope else "this API key's own"
            retry_s = admission.retry_after_s
            raise RateLimited(
                f"Rate limit reached for {whose} (requests_per_minute: limit "
                f"{refused.capacity}; a token count takes one request). Please try again in "
                f"{format_reset(retry_s)}.",
                retry_after_s=retry_s,
            )

    def _undo_later(self, exc: StorageError, hold: RateLimitHold) -> None:
        """Free the slots a timed-out admission may still take once storage catches up."""
        if not hold.slots:
            return
        self._failures.undo_later(exc, partial(self._release, hold), hold.lease_s)

    def _release(self, hold: RateLimitHold) -> Awaitable[None]:
        return self._store.release(hold.scope, hold.slots, lease_id=hold.lease_id)

    def _hold(
        self, ctx: Admitted, hold: RateLimitHold, shape: LimitShape, costs: list[int]
    ) -> None:
        hold.token_buckets = tuple((bucket, costs[index]) for index, bucket in shape.token_buckets)
        hold.request_buckets = shape.request_buckets
        if hold.slots:
            self._keep_leased(hold)
        ctx.rate_limits.append(hold)

    def holding(self, ctx: Admitted) -> bool:
        return bool(ctx.rate_limits)

    def settle(self, ctx: Admitted) -> Awaitable[None]:
        """Free the slots and true the token buckets up to real usage; runs once, in `finally`.
        The store calls are made now; the awaitable ends with them."""
        holds, ctx.rate_limits = ctx.rate_limits, []
        used = (ctx.input_tokens or 0) + (ctx.output_tokens or 0)
        return self._given_back(ctx.tenant_name, holds, used, refused=refused_unsent(ctx))

    def give_back_backend(self, ctx: Admitted, backend: Backend) -> Awaitable[None]:
        """`backend` failed before answering and the request moves to another: its slot is free
        at once and its token buckets get back what they were charged (it generated nothing;
        settling would charge them what the next backend generates)."""
        scope = scopes.backend_scope(backend.name)
        holds = [hold for hold in ctx.rate_limits if hold.scope == scope]
        ctx.rate_limits = [hold for hold in ctx.rate_limits if hold.scope != scope]
        return self._given_back(ctx.tenant_name, holds, 0, refused=False)

    def _given_back(
        self, tenant: str, holds: list[RateLimitHold], used: int, *, refused: bool
    ) -> Awaitable[None]:
        """Free the holds' slots and true their token buckets up to `used`; a `refused`
        request's request buckets get back the one it took."""
        now, policy = self._clock.wall(), self._serving()
        releases: list[tuple[RateLimitHold, Awaitable[None]]] = []
        true_ups: list[TrueUp] = []
        for hold in holds:
            hold.end()
            if hold.slots:
                released = self._store.release(hold.scope, hold.slots, lease_id=hold.lease_id)
                releases.append((hold, released))
            owed = [(b, used - charged) for b, charged in hold.token_buckets if used != charged]
            owed += [(bucket, -1) for bucket in hold.request_buckets] if refused else []
            for bucket, delta in owed:
                sized = sized_now(policy, bucket)
                true_ups.append(self.true_ups.send(hold.scope, sized, delta, now=now))
        return self._settled(tenant, releases, true_ups)

    async def _settled(
        self,
        tenant: str,
        releases: list[tuple[RateLimitHold, Awaitable[None]]],
        true_ups: list[TrueUp],
    ) -> None:
        for hold, released in releases:
            try:
                await released
            except StorageError as exc:
                # Sent again: else it is held to its lease's end, max_concurrent refusing all along.
                _log.warning("could not free the slots of %s yet: %s", tenant, exc)
                self._failures.resend(partial(self._release, hold), hold.lease_s)
            else:
                self._wake_next(hold.scope)
        for true_up in true_ups:  # kept and sent again if storage did not take it
            await self.true_ups.sent(true_up)

    async def _admit(self, ctx: Admitted, plan: LimitPlan, limits: Limits) -> Admission:
        """Admit now, or with `queue_timeout`, wait in this tenant's FIFO line for a slot. The
        store calls are shielded from the client's leaving, as Prefetch's; the waits are not."""
        hold, buckets, costs = plan.hold, plan.shape.buckets, plan.costs
        if not plan.step.taken:
            with ctx.scope.shielded():
                await plan.step.run(self._store)
        admission = plan.step.answer
        if admission.admitted or limits.queue_timeout is None or not admission.by_slot(buckets):
            return admission
        joined_s = self._clock.monotonic()
        deadline = joined_s + limits.queue_timeout
        line = self._queues.setdefault(hold.scope, deque())
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        line.append(turn)
        try:
            while True:
                left_s = deadline - self._clock.monotonic()
                if left_s <= 0:
                    return admission
                if line[0] is turn:  # at the limits now: a reload may have come meanwhile
                    policy = self._serving()
                    buckets = tuple(sized_now(policy, bucket) for bucket in buckets)
                    hold.slots = tuple(sized_now(policy, pool) for pool in hold.slots)
                    with ctx.scope.shielded():
                        admission = await self._try(hold, buckets, costs)
                    if admission.admitted or not admission.by_slot(buckets):
                        return admission
                # Woken by a release in this process, or poll for releases by other replicas.
                await asyncio.wait([turn], timeout=min(left_s, _QUEUE_POLL_S))
                if turn.done():
                    turn = asyncio.get_running_loop().create_future()
                    line[0] = turn
        finally:
            ctx.meter.waited(self._clock.monotonic() - joined_s)
            line.remove(turn)
            if not line:
                self._queues.pop(hold.scope, None)
            self._wake_next(hold.scope)

    def _step(self, hold: RateLimitHold, buckets: Sequence[Bucket], costs: list[int]) -> Admit:
        now = self._clock.wall()
        return Admit(
            hold.scope, buckets, costs, hold.slots,
            lease_id=hold.lease_id, lease_until=now + hold.lease_s, now=now,
        )  # fmt: skip

    async def _try(
        self, hold: RateLimitHold, buckets: Sequence[Bucket], costs: list[int]
    ) -> Admission:
        step = self._step(hold, buckets, costs)
        await step.run(self._store)
        return step.answer

    def _wake_next(self, scope: str) -> None:
        line = self._queues.get(scope)
        if line and not line[0].done():
            line[0].set_result(None)

    def _keep_leased(self, hold: RateLimitHold) -> None:
        def renew(until: float) -> Awaitable[bool]:
            return self._store.renew(
                hold.scope, hold.slots, lease_id=hold.lease_id, lease_until=until
            )

        self._renewals.keep(hold, renew)


def _token_cost(ctx: Admitted) -> int:
    return (ctx.counted_input_tokens or 0) + (ctx.outgoing.reserved_output() or 0)
