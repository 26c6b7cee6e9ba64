"""Quotas: reserve input + allowed output (every answer's) before the call, settle to real usage
after it.

Writes reservation, and a `max_tokens` bound when a quota needs one the client did not give or,
with `stop_stream_at_budget`, when only a shorter answer fits what is left of a quota.
"""

from __future__ import annotations

import calendar
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import ClassVar

from proxy.clock import Clock
from proxy.context import Admitted
from proxy.cost import PriceTable
from proxy.errors import InsufficientQuota, RateLimited
from proxy.holds import Quota, Reservation
from proxy.leases import LeaseIds, Renewals
from proxy.outgoing import DEFAULT_OUTPUT_BOUND
from proxy.policy.model import Budget
from proxy.stages.prefetch import Plan, taken
from proxy.stages.storagepolicy import StorageFailures, warned
from proxy.stages.unbooked import Unbooked, UnbookedSettle
from proxy.storage.base import Counter, QuotaStore, StorageError, StorageRefused, StorageUnsent
from proxy.storage.joint import Reserve
from proxy.storage.scopes import tenant_scope
from proxy.together import nothing

__all__ = ["IN_FLIGHT_RETRY_S", "Budgets", "QuotaPlan", "Refusing"]

_NUSD_PER_USD = 1_000_000_000
# A quota that only requests in flight hold frees as they end (a reservation is mostly an
# answer's allowance, given back unused): retry soon, as a full slot pool says.
IN_FLIGHT_RETRY_S = 1.0
_log = logging.getLogger("tokenweir.budget")
# Called before a quota refuses a request (the rate-limit headers it still shows).
Refusing = Callable[[Admitted], Awaitable[None]]


@dataclass(slots=True)
class QuotaPlan:
    """A reservation to make for the request as it stands, and what a refusal is judged by."""

    reservation: Reservation
    input_tokens: int
    output_tokens: int
    amounts: list[int]
    step: Reserve

    @property
    def steps(self) -> tuple[Reserve]:
        return (self.step,)


class Budgets:
    span_name: ClassVar[str] = "tokenweir.budget.reserve"
    given_back_at_settle: ClassVar[bool] = True

    def __init__(
        self,
        store: QuotaStore,
        prices: PriceTable,
        clock: Clock,
        failures: StorageFailures,
        *,
        refusing: Refusing | None = None,
        unbooked: Unbooked | None = None,
    ) -> None:
        """`unbooked` keeps the settles storage could not take, to send again (without it,
        such a settle is logged and lost from the quota, as its use is in the ledger)."""
        self._store = store
        self._unbooked = unbooked
        self._refusing = refusing
        self._failures = failures
        self._prices = prices
        self._clock = clock
        self._charges_failing = False
        self._quotas = _DailyQuotas()
        self._lease_ids = LeaseIds()
        self._renewals = Renewals(clock, _log, "a quota lease")

    def touched(self, ctx: Admitted) -> bool:
        """The tenant has a quota: the stage reserved against it in storage."""
        budget = ctx.tenant.budget
        return bool(
            budget.tokens_per_day
            or budget.tokens_per_month
            or budget.usd_per_day
            or budget.usd_per_month
        )

    async def __call__(self, ctx: Admitted) -> None:
        plan = taken(ctx, QuotaPlan) or self.plan(ctx)
        if plan is None:
            return
        for _ in range(len(plan.reservation.quotas) + 1):
            step = plan.step
            if not step.taken:  # else the prefetch took it, and undoes it if it timed out
                with ctx.scope.shielded():  # as Prefetch: what the call takes is then settled
                    await step.run(self._store)
                if step.error is not None:
                    # A reservation that timed out may still be made once storage catches up:
                    # release it then, or it would hold the quota until its lease ends.
                    self._failures.undo_later(step.error, *step.undo(self._store))
            if step.error is not None:
                self._failures.decide("quota", ctx.tenant.limits, step.error)
                return
            if not step.refused:
                self._keep_leased(plan.reservation)
                ctx.reservation = plan.reservation
                return
            if not self.replan(ctx, plan):
                if self._refusing is not None:
                    await self._refusing(ctx)
                raise self._refusal(plan)
            plan = self.plan(ctx)
            if plan is None:
                return
        raise RuntimeError("quota reservation did not settle on an amount")

    def plan(self, ctx: Admitted) -> QuotaPlan | None:
        """Input + allowed output on each of the tenant's quotas; None without quotas."""
        now = self._clock.wall()
        quotas = self.quotas(ctx)
        if not quotas:
            return None
        lease_id, lease_s = self._lease_ids.next(), ctx.tenant.limits.lease_ttl
        reservation = Reservation(tenant_scope(ctx.tenant_name), lease_id, lease_s, quotas)
        input_tokens, output_tokens = ctx.counted_input_tokens or 0, self._output_bound(ctx)
        amounts = [self._reserved(ctx, q, input_tokens, output_tokens) for q in quotas]
        step = Reserve(
            reservation.scope, reservation.lease_id, [q.counter for q in quotas], amounts,
            lease_until=now + lease_s, now=now,
        )  # fmt: skip
        return QuotaPlan(reservation, input_tokens, output_tokens, amounts, step)

    def quotas(self, ctx: Admitted) -> tuple[Quota, ...]:
        """The tenant's quotas (none without a budget) of the day and month the request was
        received in, as the ledger dates its record: not of when this stage runs, which may be
        past midnight for a request received before it."""
        return self._quotas.of(ctx.tenant_name, ctx.tenant.budget, ctx.received_wall)

    def replan(self, ctx: Admitted, plan: Plan) -> bool:
        """After a refusal, with `stop_stream_at_budget`: bound the answer to the output that
        still fits the refusing quota, and say so (True), for a new reservation."""
        if not isinstance(plan, QuotaPlan) or not plan.step.refused:
            return False
        refusal = plan.step.answer
        if refusal is None:
            return False
        quota = plan.reservation.quotas[refusal.index]
        left = refusal.used + refusal.reserved
        fits = self._output_that_fits(ctx, quota, left, plan.input_tokens)
        answers = ctx.outgoing.answers
        each = fits // answers  # every answer gets the same bound
        if not _may_shorten(ctx) or not 1 <= each < plan.output_tokens // answers:
            return False
        ctx.outgoing.bound_output(each, "budget")  # the backend ends it with finish_reason length
        return True

    def _refusal(self, plan: QuotaPlan) -> InsufficientQuota | RateLimited:
        refusal = plan.step.answer
        if refusal is None:
            raise RuntimeError("the reservation was not refused")
        quota, needed = plan.reservation.quotas[refusal.index], plan.amounts[refusal.index]
        return _refused(quota, refusal.used, refusal.reserved, needed, plan.step.now)

    def _amount(self, model: str, quota: Quota, input_tokens: int, output_tokens: int) -> int:
        """What the tokens used on `model` take from the quota."""
        if quota.in_usd:
            return self._prices.cost_nusd(model, input_tokens, output_tokens)
        return input_tokens + output_tokens

    def _reserved(self, ctx: Admitted, quota: Quota, input_tokens: int, output_tokens: int) -> int:
        """What a request reserves: priced as if the dearest model that may answer it did (a
        fallback, or one a degradation rule switches to)."""
        if quota.in_usd:
            return self._prices.ceiling_nusd(
                ctx.model, input_tokens, output_tokens, ctx.tenant_name
            )
        return input_tokens + output_tokens

    def _output_that_fits(self, ctx: Admitted, quota: Quota, taken: int, input_tokens: int) -> int:
        """The most output tokens this quota still holds beside the input (may be < 1)."""
        room = quota.counter.limit - taken - self._reserved(ctx, quota, input_tokens, 0)
        if not quota.in_usd:
            return room
        per_million = self._prices.ceiling_nusd(ctx.model, 0, 1_000_000, ctx.tenant_name)
        return room * 1_000_000 // per_million if per_million else DEFAULT_OUTPUT_BOUND

    def holding(self, ctx: Admitted) -> bool:
        return ctx.reservation is not None

    def settle(self, ctx: Admitted) -> Awaitable[None]:
        """Release the reservation and book what was really used; runs once, in `finally`. The
        store call is made now; the awaitable ends with it."""
        reservation, ctx.reservation = ctx.reservation, None
        if reservation is None:
            return nothing()
        reservation.end()
        input_tokens = (
            ctx.input_tokens if ctx.input_tokens is not None else ctx.counted_input_tokens
        )
        used = self._used(ctx.model, reservation, input_tokens or 0, ctx.output_tokens or 0)
        # The whole usage: the store books what the lease's charges did not (those that never
        # ran too); `charged` is only for a lease storage no longer holds.
        booked = reservation.charged
        counters = [q.counter for q in reservation.quotas]
        settling = self._store.settle(
            reservation.scope, reservation.lease_id, counters, used, booked=booked
        )
        if self._unbooked is None:
            # Failing, the lease expires on its own: the use is lost from the quota, not the
            # ledger.
            return warned(settling, _log, "could not settle quota for %s: %s", ctx.tenant_name)
        kept = UnbookedSettle(
            ctx.tenant_name, reservation.scope, reservation.lease_id, counters, used, booked
        )
        return _settled(settling, kept, self._unbooked)

    def charge_so_far(
        self, ctx: Admitted, input_tokens: int, output_tokens: int
    ) -> Awaitable[None] | None:
        """The booking of a running request's usage so far on its quotas, or None when nothing
        grew since the last one. It carries the whole usage so far: the store books what its
        lease's earlier charges did not, so one lost on its way is made up by this one (or the
        settle), and one that ran is not booked again. Noted on the reservation at once."""
        reservation = ctx.reservation
        if reservation is None:
            return None
        used = self._used(ctx.model, reservation, input_tokens, output_tokens)
        booked = reservation.charged
        grown = [max(0, u - c) for u, c in zip(used, booked, strict=True)]
        if not any(grown):
            return None
        reservation.charged = [c + g for c, g in zip(booked, grown, strict=True)]
        return self._charge(ctx.tenant_name, reservation, used, booked, grown)

    async def _charge(
        self,
        tenant: str,
        reservation: Reservation,
        used: list[int],
        booked: list[int],
        grown: list[int],
    ) -> None:
        counters = [q.counter for q in reservation.quotas]
        scope, lease_id = reservation.scope, reservation.lease_id
        try:
            await self._store.charge(scope, lease_id, counters, used, booked=booked)
        except StorageError as exc:
            # A charge that timed out or lost its connection may have run: it stays counted,
            # which matters only where the lease is gone by the next booking (else the store
            # books from what the lease recorded). One that never ran (never sent, or Redis
            # refused to write) is taken back. Logged once per outage: every open stream
            # fails each second while storage is down.
            if isinstance(exc, StorageUnsent | StorageRefused):
                charged = zip(reservation.charged, grown, strict=True)
                reservation.charged = [c - g for c, g in charged]
            log = _log.debug if self._charges_failing else _log.warning
            self._charges_failing = True
            log("could not book usage so far on quota for %s: %s", tenant, exc)
        else:
            if self._charges_failing:
                self._charges_failing = False
                _log.warning("booking usage so far on quotas works again")

    def _used(
        self, model: str, reservation: Reservation, input_tokens: int, output_tokens: int
    ) -> list[int]:
        return [self._amount(model, q, input_tokens, output_tokens) for q in reservation.quotas]

    def _output_bound(self, ctx: Admitted) -> int:
        """The output to reserve: every answer (`n`, a batch's prompts) at its bound."""
        if ctx.operation == "embeddings":
            return 0
        return ctx.outgoing.held_output()

    def _keep_leased(self, reservation: Reservation) -> None:
        """Renew the lease while the request runs (a long stream outlives one lease)."""

        def renew(until: float) -> Awaitable[bool]:
            return self._store.renew(reservation.scope, reservation.lease_id, lease_until=until)

        self._renewals.keep(reservation, renew)


async def _settled(settling: Awaitable[None], kept: UnbookedSettle, unbooked: Unbooked) -> None:
    """Wait for a settle; one storage did not take is kept and sent again (on the counters of
    the day the request was admitted in, however late it is booked)."""
    try:
        await settling
    except StorageError as exc:
        log = _log.debug if unbooked.pending else _log.warning
        log("could not settle quota for %s, kept to send again: %s", kept.tenant, exc)
        unbooked.keep(kept, exc)


def _may_shorten(ctx: Admitted) -> bool:
    return ctx.tenant.budget.stop_stream_at_budget and ctx.operation != "embeddings"


class _DailyQuotas:
    """Each tenant's quotas, built once a (UTC) day: their counters change only at midnight."""

    def __init__(self) -> None:
        self._built: dict[str, tuple[Budget, float, tuple[Quota, ...]]] = {}

    def of(self, tenant: str, budget: Budget, now: float) -> tuple[Quota, ...]:
        built = self._built.get(tenant)
        day = now - now % 86400
        if built is not None and built[0] is budget and built[1] == day:
            return built[2]
        quotas = _quotas(tenant, budget, now)
        self._built[tenant] = (budget, day, quotas)
        return quotas


def _quotas(tenant: str, budget: Budget, now: float) -> tuple[Quota, ...]:
    day, month = time.gmtime(now), time.gmtime(now)
    day_end = calendar.timegm((day.tm_year, day.tm_mon, day.tm_mday + 1, 0, 0, 0))
    next_month = (month.tm_year + month.tm_mon // 12, month.tm_mon % 12 + 1, 1, 0, 0, 0)
    month_end = calendar.timegm(next_month)
    day_tag, month_tag = time.strftime("%Y%m%d", day), time.strftime("%Y%m", month)
    scope = tenant_scope(tenant)
    wanted = (
        ("tokens_per_day", False, budget.tokens_per_day, f"tokens:d:{day_tag}", day_end),
        ("tokens_per_month", False, budget.tokens_per_month, f"tokens:m:{month_tag}", month_end),
        ("usd_per_day", True, budget.usd_per_day, f"usd:d:{day_tag}", day_end),
        ("usd_per_month", True, budget.usd_per_month, f"usd:m:{month_tag}", month_end),
    )
    return tuple(
        Quota(name, in_usd, Counter(f"{scope}:q:{key}", _limit(limit, in_usd), end + 86400))
        for name, in_usd, limit, key, end in wanted
        if limit is not None
    )


def _limit(limit: float, in_usd: bool) -> int:
    return round(limit * _NUSD_PER_USD) if in_usd else int(limit)


def _refused(
    quota: Quota, used: int, reserved: int, needed: int, now: float
) -> InsufficientQuota | RateLimited:
    """`insufficient_quota` only for a quota really spent: OpenAI's code for "check your plan
    and billing", which clients stop on. One held by requests in flight is a rate limit."""
    reset_at = quota.counter.expires_at - 86400
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(reset_at))
    if quota.in_usd:
        unit = "USD"
        limit, used_s, reserved_s, needed_s = (
            f"{v / _NUSD_PER_USD:.6f}" for v in (quota.counter.limit, used, reserved, needed)
        )
    else:
        unit = "tokens"
        limit, used_s, reserved_s, needed_s = (
            str(v) for v in (quota.counter.limit, used, reserved, needed)
        )
    if needed > quota.counter.limit:
        return InsufficientQuota(
            f"This request needs up to {needed_s} {unit}, more than {quota.name} ({limit} "
            f"{unit}) allows in a whole period: it can never be admitted. Lower max_tokens or n, "
            "send fewer prompts, or shorten the input.",
            retry_after_s=max(1.0, reset_at - now),  # when the quota resets: still too small
            should_retry=False,
        )
    held = f"{quota.name} is {limit} {unit}; {used_s} used and {reserved_s} held by requests in "
    held += f"flight, and this request needs up to {needed_s}"
    if used + needed <= quota.counter.limit:
        return RateLimited(
            f"Requests in flight hold this quota: {held}. It fits once they end (what they do "
            "not use is given back); please try again shortly.",
            retry_after_s=IN_FLIGHT_RETRY_S,
        )
    return InsufficientQuota(
        f"You exceeded your current quota: {held}. It resets at {when}.",
        retry_after_s=max(1.0, reset_at - now),
    )
