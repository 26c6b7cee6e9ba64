"""Degradation: the tenant's first matching `degrade:` rule changes the request, and under
overload the lowest priorities are shed first.

Writes degrade_choice and the planned output bound (DegradeChoice, before shaping and admission,
so that a rule's model is the one whose tokenizer counts the input, and its max_output_tokens what
quotas and rate limits reserve); then degraded, degraded_shadow,
and per the chosen rule's `then`: cache_min_similarity / cache_serve_stale (and the cache's second
lookup), then, unless that hit, body max_tokens, output_allowance, model; or an error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

from proxy.clock import Clock
from proxy.context import Admitted, Chosen, Operation
from proxy.errors import GatewayError, RateLimited, UpstreamUnavailable
from proxy.holds import Quota
from proxy.policy.model import DegradeRule, DegradeThen, DegradeWhen, Tenant
from proxy.routing.pool import Pools, PoolSignals
from proxy.stages import Stage
from proxy.stages.inflight import SharedInflight
from proxy.stages.storagepolicy import StorageFailures
from proxy.storage.base import QuotaStore, StorageError

__all__ = [
    "SHED_AT",
    "STORAGE_WINDOW_S",
    "Degrade",
    "DegradeChoice",
    "name_reserving_rule",
    "spilled_to",
]

Priority = Literal["low", "normal", "high"]
_NO_RULE: Chosen = (None, None)  # a tenant without rules: no signal is read
# Shed a request of this priority when the model's backends are this full (in flight over
# their max_concurrent), keeping the rest for higher priorities: low goes first at 80%, normal
# at 95%; high is refused only by the backends' own limits, when they are full.
SHED_AT: dict[str, float] = {"low": 0.8, "normal": 0.95}
STORAGE_WINDOW_S = 10.0  # `storage_unavailable`: shared storage failed this recently
SHED_RULE = "priority-shed"  # the name a shed request records in shadow mode
_log = logging.getLogger("tokenweir.degrade")


class _Signals:
    """The request's signals, each read at most once and only if a rule asks for it."""

    def __init__(self, stage: Degrade, ctx: Admitted) -> None:
        self._stage = stage
        self._ctx = ctx
        self._pool: PoolSignals | None = None
        self._budget: float | None = None
        self._budget_read = False

    async def count_inflight(self) -> None:
        """Before the pool's signals are read: its backends' requests in flight, across
        replicas."""
        if self._pool is None and self._stage.inflight is not None:
            await self._stage.inflight.refresh(self._stage.pools.pool(self._ctx.model))

    def pool(self) -> PoolSignals:
        if self._pool is None:
            pool = self._stage.pools.pool(self._ctx.model)
            self._pool = pool.signals(self._stage.clock.monotonic())
        return self._pool

    async def budget_used(self) -> float | None:
        if not self._budget_read:
            self._budget_read = True
            self._budget = await self._stage.budget_used(self._ctx)
        return self._budget


class Degrade:
    def __init__(
        self,
        pools: Pools,
        clock: Clock,
        store: QuotaStore,
        failures: StorageFailures,
        cache: Stage | None = None,
        quotas: Callable[[Admitted], tuple[Quota, ...]] | None = None,
        inflight: SharedInflight | None = None,
    ) -> None:
        self.pools = pools
        self.inflight = inflight  # the count across replicas, where this process's is stale
        self.clock = clock
        self._store = store
        self._failures = failures
        self._cache = cache
        self._quotas = quotas  # the tenant's, for budget_used_above before a reservation

    async def __call__(self, ctx: Admitted) -> None:
        tenant = ctx.tenant
        chosen = ctx.degrade_choice  # DegradeChoice's: what was reserved counts on it
        if chosen is None:
            chosen = await self.choose(ctx) if tenant.degrade else _NO_RULE
        live, shadow = chosen
        if shadow is not None:
            ctx.degraded_shadow.append(shadow.name)
        priority: Priority = tenant.priority
        if live is not None:
            priority = await self._apply(ctx, live)
        if ctx.cached is None:
            await self._shed(ctx, priority, shadow=tenant.shadow)

    async def choose(self, ctx: Admitted) -> Chosen:
        """The tenant's first matching enforced rule and first matching shadow rule."""
        return await self._first_matches(ctx.tenant, _Signals(self, ctx))

    async def _first_matches(self, tenant: Tenant, signals: _Signals) -> Chosen:
        """The first matching enforced rule, and the first matching rule of all if it is a
        shadow one (what would have happened had the shadow rules been live)."""
        live: DegradeRule | None = None
        shadow: DegradeRule | None = None
        first = True
        for rule in tenant.degrade:
            in_shadow = rule.shadow or tenant.shadow
            if (in_shadow and not first) or not await self._matches(rule.when, signals):
                continue
            if first and in_shadow:
                shadow = rule
            first = False
            if not in_shadow:
                live = rule
                break
        return live, shadow

    async def _matches(self, when: DegradeWhen, signals: _Signals) -> bool:
        """Every condition the rule sets holds (a rule with none always matches)."""
        if when.storage_unavailable is not None:
            failing = self._failures.failed_within(STORAGE_WINDOW_S)
            if failing != when.storage_unavailable:
                return False
        if when.inflight_ratio_above is not None:
            await signals.count_inflight()
        checks = (
            (when.inflight_ratio_above, lambda: signals.pool().inflight_ratio),
            (when.queue_depth_above, lambda: signals.pool().queue_depth),
            (when.backend_ttft_p95_above, lambda: signals.pool().ttft_p95_s),
            (when.backend_error_rate_above, lambda: signals.pool().error_rate),
        )
        for threshold, read in checks:
            if threshold is not None:
                value = read()
                if value is None or value <= threshold:
                    return False
        if when.budget_used_above is not None:
            used = await signals.budget_used()
            if used is None or used <= when.budget_used_above:
                return False
        return True

    async def budget_used(self, ctx: Admitted) -> float | None:
        """The largest settled fraction of the tenant's quotas (None: no quotas, or unreadable)."""
        reservation = ctx.reservation
        if reservation is not None:
            quotas = reservation.quotas
        else:
            quotas = self._quotas(ctx) if self._quotas is not None else ()
        if not quotas:
            return None
        counters = [quota.counter for quota in quotas]
        try:
            readings = await self._store.read(counters)
        except StorageError as exc:
            _log.warning("could not read quotas for budget_used_above: %s", exc)
            return None
        return max(used / c.limit for c, (used, _) in zip(counters, readings, strict=True))

    async def _apply(self, ctx: Admitted, rule: DegradeRule) -> Priority:
        """Apply the rule; its name is recorded only if it changed the request (a client's own
        lower bound, an embeddings request under a spill or output rule, a second cache lookup
        that found nothing, a priority the tenant has already: nothing changed)."""
        then = rule.then
        if then.reject is not None:
            ctx.degraded.append(rule.name)
            raise _rejection(rule.name, then)
        tenant_priority = ctx.tenant.priority
        changed = then.priority is not None and then.priority != tenant_priority
        if then.cache is not None or then.similarity is not None:
            ctx.cache_serve_stale = then.cache == "serve_stale"
            ctx.cache_min_similarity = then.similarity
            if ctx.cache == "miss" and self._cache is not None:
                # Look again, at the looser bar, for the request as the client sent it (its
                # stale answer): before the rule shortens it or sends it to another model,
                # which no stored answer is for. A hit is served as it is.
                await self._cache(ctx)
                changed = changed or ctx.cached is not None
        if ctx.cached is None:
            changed = _reshape(ctx, rule) or changed
        if changed:
            ctx.degraded.append(rule.name)
        priority: Priority = then.priority or tenant_priority
        return priority

    async def _shed(self, ctx: Admitted, priority: Priority, *, shadow: bool) -> None:
        """Refuse the request if its priority is shed at the model's current load."""
        shed_at = SHED_AT.get(priority)
        if shed_at is None:
            return
        pool = self.pools.pool(ctx.model)
        if not pool.capacity:  # no backend of the model has max_concurrent: nothing is shed
            return
        if self.inflight is not None:
            await self.inflight.refresh(pool)
        ratio = pool.inflight_ratio(self.clock.monotonic())
        if ratio is None or ratio < shed_at:
            return
        if shadow:
            ctx.degraded_shadow.append(SHED_RULE)
            return
        raise UpstreamUnavailable(
            f"The model {ctx.model!r} is overloaded and {priority}-priority requests are shed "
            "first; try again shortly.",
            code="overloaded",
            retry_after_s=1.0,
        )


class DegradeChoice:
    """Chooses the rule before shaping and admission (the stage applies it after the cache
    lookup): a rule's `max_output_tokens` is then the bound that quotas and rate limits reserve,
    where they held the bound it lowers and refused requests that it would have let fit; and
    its `model` the one whose tokenizer shaping counts with, where the asked model's count was
    held to `max_input_tokens`, reserved and billed (a backend without usage) for another's."""

    def __init__(self, degrade: Degrade) -> None:
        self._degrade = degrade

    async def __call__(self, ctx: Admitted) -> None:
        if not ctx.tenant.degrade:
            return
        ctx.degrade_choice = live, _ = await self._degrade.choose(ctx)
        if live is not None and ctx.operation != "embeddings":
            ctx.outgoing.planned_bound = live.then.max_output_tokens


def spilled_to(rule: DegradeRule | None, operation: Operation) -> str | None:
    """The model a live rule sends a request of `operation` to (None: it keeps its own). Never
    an embedding's: another model's vectors are of another space, which no client could tell
    from the ones it has stored (they were sent to the rule's chat model)."""
    if rule is None or operation == "embeddings":
        return None
    return rule.then.model


def name_reserving_rule(ctx: Admitted) -> None:
    """Before a 429 of the quotas or rate limits: name the chosen rule if what they reserved
    was the rule's (its output bound below the request's own, or its model's count), as the
    answer would have, since the client's own request may have fit or been refused otherwise."""
    choice = ctx.degrade_choice
    rule = choice[0] if choice is not None else None
    if rule is None or rule.name in ctx.degraded:
        return
    spill = spilled_to(rule, ctx.operation)
    planned, bound = ctx.outgoing.planned_bound, ctx.outgoing.allowance
    lowered = planned is not None and (bound is None or planned < bound)
    if lowered or (spill is not None and spill != ctx.model):
        ctx.degraded.append(rule.name)


def _reshape(ctx: Admitted, rule: DegradeRule) -> bool:
    """The rule's output bound and model applied: True if either changed the request."""
    changed = False
    limit = rule.then.max_output_tokens
    if limit is not None and ctx.operation != "embeddings":
        changed = ctx.outgoing.bound_output(limit, None)  # recorded as the rule's name
    model = spilled_to(rule, ctx.operation)
    if model is not None and model != ctx.model:
        ctx.outgoing.set_model(model)
        changed = True
    return changed


def _rejection(name: str, then: DegradeThen) -> GatewayError:
    message = f"Request refused by the degradation rule {name!r}; try again in a moment."
    if then.reject == 429:
        return RateLimited(message, retry_after_s=then.retry_after)
    return UpstreamUnavailable(message, code="degraded", retry_after_s=then.retry_after)
