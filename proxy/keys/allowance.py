"""A runtime key's own budget and limits, on top of its tenant's: tokens per day and month
(reserved, then settled to real usage) and requests and tokens per minute (token buckets).

Runs after the tenant's budget and rate limits; holds what it reserved until Account settles.
A running stream's checkpoints book its usage so far on the key's counters, as on the tenant's.
"""

from __future__ import annotations

import calendar
import contextlib
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from proxy.clock import Clock
from proxy.context import Admitted
from proxy.errors import MINUTE_S, InsufficientQuota, RateLimited
from proxy.keys.record import KeyAllowance, KeyRecord
from proxy.leases import Lease, LeaseIds, Renewals
from proxy.stages.budget import IN_FLIGHT_RETRY_S, Refusing
from proxy.stages.limitheaders import format_reset, rate_limit_headers
from proxy.stages.limitrefusal import refused_unsent
from proxy.stages.limitshape import limit_key, per_minute
from proxy.stages.prefetch import Plan, taken
from proxy.stages.storagepolicy import StorageFailures
from proxy.stages.trueups import MissedTrueUps
from proxy.stages.unbooked import Unbooked, UnbookedSettle
from proxy.storage.base import (
    Counter,
    QuotaStore,
    Refusal,
    StorageError,
    StorageRefused,
    StorageUnsent,
)
from proxy.storage.joint import Admit, Reserve, Step
from proxy.storage.limits import Bucket, LimitStore
from proxy.together import nothing

__all__ = ["KeyAllowances", "KeyPlan"]

# A dead replica's reservation for a key is released after this (a running request renews it).
_LEASE_S = 600.0
_log = logging.getLogger("tokenweir.keys")


@dataclass(slots=True)
class _Hold:
    record: KeyRecord
    scope: str
    lease_id: str
    counters: tuple[Counter, ...] = ()
    lease: Lease | None = None  # the reservation's, renewed while the request runs
    tpm: tuple[Bucket, int] | None = None
    rpm: Bucket | None = None  # given its request back if the request is refused later
    refused: bool = False
    charged: int = 0  # usage so far sent by checkpoints (stages/checkpoint.py), as budget.py's


@dataclass(slots=True)
class KeyPlan:
    """The key's reservation on its own counters, then its own buckets; either may be None."""

    hold: _Hold
    tokens: int
    reserve: Reserve | None
    admit: Admit | None

    @property
    def steps(self) -> tuple[Step[Any], ...]:
        return tuple(step for step in (self.reserve, self.admit) if step is not None)


class KeyAllowances:
    def __init__(
        self,
        store: QuotaStore,
        limits: LimitStore,
        clock: Clock,
        failures: StorageFailures,
        refusing: Refusing | None = None,
        unbooked: Unbooked | None = None,
        true_ups: MissedTrueUps | None = None,
    ) -> None:
        """`unbooked` keeps the key's quota settles storage could not take, to send again;
        `true_ups` its token buckets' true-ups."""
        self._true_ups = true_ups
        self._store = store
        self._unbooked = unbooked
        self._refusing = refusing
        self._limits = limits
        self._clock = clock
        self._failures = failures
        self._holds: dict[Admitted, _Hold] = {}
        self._lease_ids = LeaseIds()
        self._renewals = Renewals(clock, _log, "a runtime key's quota lease")

    def note(self, ctx: Admitted, record: KeyRecord) -> None:
        """Auth found a runtime key; only one with an allowance of its own needs more."""
        allowance = record.allowance
        if not allowance.empty:
            self._holds[ctx] = _Hold(record, record.scope, self._lease_ids.next())
            ctx.key_counts_tokens = bool(
                allowance.tokens_per_day
                or allowance.tokens_per_month
                or allowance.tokens_per_minute
            )

    async def __call__(self, ctx: Admitted) -> None:
        plan = taken(ctx, KeyPlan) or self.plan(ctx)
        if plan is None:
            return
        try:
            if plan.reserve is not None:
                await self._reserve(ctx, plan.hold, plan.reserve, plan.tokens)
            if plan.admit is not None:
                if not plan.admit.taken:
                    with ctx.scope.shielded():  # as Prefetch's: what the call takes is settled
                        await plan.admit.run(self._limits)
                self._admitted(ctx, plan.hold, plan.admit, plan.tokens)
        except StorageError as exc:  # the tenant's on_storage_error decides, as for its quota
            self._failures.decide("key_allowance", ctx.tenant.limits, exc)

    async def _reserve(self, ctx: Admitted, hold: _Hold, step: Reserve, tokens: int) -> None:
        """Reserve on the key's counters (unless the prefetch did), or refuse as they did."""
        if not step.taken:  # else the prefetch took it, and undoes it if it timed out
            with ctx.scope.shielded():  # as Prefetch's: what the call takes is settled
                await step.run(self._store)
            if step.error is not None:
                self._failures.undo_later(step.error, *step.undo(self._store))
        refusal = step.answer  # a StorageError goes up to the caller
        if refusal is not None:
            hold.refused = True
            if self._refusing is not None:
                await self._refusing(ctx)
            raise _refused(step.counters[refusal.index], refusal, tokens, step.now)
        hold.counters = tuple(step.counters)
        self._keep_leased(hold)

    def plan(self, ctx: Admitted) -> KeyPlan | None:
        """The key's counters and buckets for this request; None for a key without its own."""
        hold = self._holds.get(ctx)
        if hold is None:
            return None
        allowance, now = hold.record.allowance, self._clock.wall()
        tokens_held = allowance.tokens_per_day or allowance.tokens_per_month
        tokens = ctx.counted_input_tokens or 0
        if ctx.operation != "embeddings" and (tokens_held or allowance.tokens_per_minute):
            tokens += ctx.outgoing.held_output()
        # The day and month the request was received in, as the ledger dates it.
        counters = _counters(hold.scope, allowance, ctx.received_wall)
        reserve = None
        if counters:
            reserve = Reserve(
                hold.scope, hold.lease_id, counters, [tokens] * len(counters),
                lease_until=now + _LEASE_S, now=now,
            )  # fmt: skip
        buckets, costs = _buckets(hold.scope, allowance, tokens)
        admit = None
        if buckets:
            admit = Admit(
                hold.scope, buckets, costs, (), lease_id=hold.lease_id, lease_until=now, now=now
            )
        return KeyPlan(hold, tokens, reserve, admit)

    def replan(self, ctx: Admitted, plan: Plan) -> bool:
        return False

    def _admitted(self, ctx: Admitted, hold: _Hold, step: Admit, tokens: int) -> None:
        """Refuse as the key's buckets did, or note its tokens-per-minute charge to true up.
        Its buckets give the x-ratelimit-* headers (the tenant's limits show theirs too, after,
        where tighter)."""
        admission = step.answer  # a StorageError goes up as it is
        buckets, costs = step.buckets, step.costs
        kinds = [limit_key(bucket).kind == "tokens" for bucket in buckets]
        ctx.rate_limit_headers = rate_limit_headers(kinds, admission.buckets)
        if not admission.admitted:
            hold.refused = True
            index = admission.refused or 0
            bucket, cost = buckets[index], costs[index]
            kind = limit_key(bucket).kind
            if admission.never:
                raise RateLimited(
                    f"This API key's {kind}_per_minute is {bucket.capacity} and this request "
                    f"needs {cost}: it can never be admitted. Lower max_tokens or n, send fewer "
                    "prompts, or shorten the input.",
                    retry_after_s=MINUTE_S,
                    should_retry=False,
                )
            refusal = RateLimited(
                f"Rate limit reached for this API key ({kind}_per_minute: limit "
                f"{bucket.capacity}). Please try again in {format_reset(admission.retry_after_s)}.",
                retry_after_s=admission.retry_after_s,
            )
            refusal.on_tokens = kind == "tokens"
            raise refusal
        if hold.record.allowance.tokens_per_minute:
            hold.tpm = (buckets[-1], costs[-1])
        if hold.record.allowance.requests_per_minute:
            hold.rpm = buckets[0]

    def _keep_leased(self, hold: _Hold) -> None:
        """Renew the reservation while the request runs: a request may outlive one lease (a
        long stream, a failover), and an expired one frees the key's quota for others."""
        lease = hold.lease = Lease(hold.scope, hold.lease_id, _LEASE_S)

        def renew(until: float) -> Awaitable[bool]:
            return self._store.renew(lease.scope, lease.lease_id, lease_until=until)

        self._renewals.keep(lease, renew)

    def holding(self, ctx: Admitted) -> bool:
        return ctx in self._holds

    def charge_so_far(
        self, ctx: Admitted, input_tokens: int, output_tokens: int
    ) -> Awaitable[None] | None:
        """The booking of a running stream's usage so far on the key's counters, or None when
        nothing grew since the last one; noted at once. As the tenant's quotas (budget.py): it
        carries the whole usage so far, so one lost on its way is made up by the next."""
        hold = self._holds.get(ctx)
        if hold is None or hold.refused or not hold.counters:
            return None
        used, booked = input_tokens + output_tokens, hold.charged
        grown = used - booked
        if grown <= 0:
            return None
        hold.charged = used
        return self._charge(hold, used, booked)

    async def _charge(self, hold: _Hold, used: int, booked: int) -> None:
        count = len(hold.counters)
        try:
            await self._store.charge(
                hold.scope, hold.lease_id, hold.counters, [used] * count, booked=[booked] * count
            )
        except StorageError as exc:
            # Taken back only when nothing of it ran, as the tenant's quotas do (budget.py): a
            # timed-out call may have landed, which matters only where the lease is gone.
            if isinstance(exc, StorageUnsent | StorageRefused):
                hold.charged -= used - booked

    def settle(self, ctx: Admitted) -> Awaitable[None]:
        """Book what the request used on the key's counters (less what checkpoints booked), true
        its token bucket up; once. The store calls are made now; the awaitable ends with them."""
        hold = self._holds.pop(ctx, None)
        if hold is None:
            return nothing()
        if hold.lease is not None:
            hold.lease.end()
        used = 0 if hold.refused else (ctx.input_tokens or 0) + (ctx.output_tokens or 0)
        calls: list[Awaitable[None]] = []
        if hold.counters:
            # The whole usage (may be below what checkpoints booked: the backend's count was
            # lower): the store books what the lease's charges did not, as budget.py's settle.
            counters, count = hold.counters, len(hold.counters)
            totals, booked = [used] * count, [hold.charged] * count
            settling = self._store.settle(
                hold.scope, hold.lease_id, counters, totals, booked=booked
            )
            if self._unbooked is not None:
                kept = UnbookedSettle(
                    ctx.tenant_name, hold.scope, hold.lease_id, counters, totals, booked
                )
                settling = _kept_if_failed(settling, kept, self._unbooked)
            calls.append(settling)
        if hold.tpm is not None and used != hold.tpm[1]:
            bucket, charged = hold.tpm
            calls.append(self._true_up(hold.scope, bucket, used - charged))
        if hold.rpm is not None and refused_unsent(ctx):  # as the tenant's limits give it back
            calls.append(self._true_up(hold.scope, hold.rpm, -1))
        return _quietly(calls)

    def _true_up(self, scope: str, bucket: Bucket, delta: int) -> Awaitable[None]:
        now = self._clock.wall()
        if self._true_ups is None:
            return self._limits.settle(scope, bucket, delta, now=now)
        return self._true_ups.sent(self._true_ups.send(scope, bucket, delta, now=now))


def _refused(
    counter: Counter, refusal: Refusal, tokens: int, now: float
) -> InsufficientQuota | RateLimited:
    """As budget.py's: a quota held only by requests in flight is a rate limit, not spent."""
    held = (
        f"{counter.limit} tokens, {refusal.used} used and {refusal.reserved} held by requests "
        f"in flight, and this request needs up to {tokens}"
    )
    if tokens > counter.limit:  # as the tenant's quotas (budget.py) say it
        return InsufficientQuota(
            f"This request needs up to {tokens} tokens, more than this API key's own quota "
            f"({counter.limit} tokens) allows in a whole period: it can never be admitted. "
            "Lower max_tokens or n, send fewer prompts, or shorten the input.",
            retry_after_s=max(1.0, counter.expires_at - 86400 - now),  # the quota's reset
            should_retry=False,
        )
    if refusal.used + tokens <= counter.limit:
        return RateLimited(
            f"Requests in flight hold this API key's own quota: {held}. It fits once they end; "
            "please try again shortly.",
            retry_after_s=IN_FLIGHT_RETRY_S,
        )
    return InsufficientQuota(
        f"This API key's own quota is used up: {held}.",
        retry_after_s=max(1.0, counter.expires_at - 86400 - now),
    )


async def _kept_if_failed(
    settling: Awaitable[None], kept: UnbookedSettle, unbooked: Unbooked
) -> None:
    """A settle of the key's quota storage did not take is kept and sent again, as the
    tenant's are (budget.py)."""
    try:
        await settling
    except StorageError as exc:
        unbooked.keep(kept, exc)


async def _quietly(calls: list[Awaitable[None]]) -> None:
    """A failed settlement: the lease expires on its own; the use is still in the ledger."""
    for call in calls:
        with contextlib.suppress(StorageError):
            await call


def _buckets(scope: str, allowance: KeyAllowance, tokens: int) -> tuple[list[Bucket], list[int]]:
    rpm, tpm = allowance.requests_per_minute, allowance.tokens_per_minute
    pairs = list(per_minute(scope, rpm, tpm, tokens))
    return [bucket for bucket, _ in pairs], [cost for _, cost in pairs]


def _counters(scope: str, allowance: KeyAllowance, now: float) -> tuple[Counter, ...]:
    day = time.gmtime(now)
    day_end = calendar.timegm((day.tm_year, day.tm_mon, day.tm_mday + 1, 0, 0, 0))
    month_end = calendar.timegm((day.tm_year + day.tm_mon // 12, day.tm_mon % 12 + 1, 1, 0, 0, 0))
    wanted = (
        (allowance.tokens_per_day, f"d:{time.strftime('%Y%m%d', day)}", day_end),
        (allowance.tokens_per_month, f"m:{time.strftime('%Y%m', day)}", month_end),
    )
    return tuple(
        Counter(f"{scope}:q:tokens:{tag}", limit, end + 86400)
        for limit, tag, end in wanted
        if limit is not None
    )
