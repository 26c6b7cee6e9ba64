"""The composition root: every collaborator a request needs under one policy, built in one place
(`Gateway.assemble`) from what outlives a reload (`Services`). The routes (proxy/web) and the app
factory (proxy/app.py) sit above it; nothing below imports it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

from proxy.clock import Clock
from proxy.cost import PriceTable
from proxy.keys.allowance import KeyAllowances
from proxy.ledger import Ledger
from proxy.pipeline import Pipeline
from proxy.policy import Policy
from proxy.reload import LiveGateway
from proxy.routing import Pools, Prober
from proxy.routing.attempts import Attempts
from proxy.services import OtelProviders, Services, bounded
from proxy.stages import Stage
from proxy.stages.account import Account, settlers_of
from proxy.stages.attribute import Attribute
from proxy.stages.auth import Authenticate, Keyring
from proxy.stages.budget import Budgets
from proxy.stages.cache import ResponseCache
from proxy.stages.checkpoint import Checkpoint
from proxy.stages.degrade import Degrade, DegradeChoice
from proxy.stages.forward import Forward
from proxy.stages.inflight import SharedInflight
from proxy.stages.parse import Parse
from proxy.stages.prefetch import Prefetch, planners_in
from proxy.stages.recount import Recount
from proxy.stages.route import Route
from proxy.stages.shape import Shape
from proxy.stages.storagepolicy import StorageFailures
from proxy.stages.stored import StoredState
from proxy.storage import QuotaStore
from proxy.telemetry.recorder import Telemetry
from proxy.tokens import TokenCounters
from proxy.upstream.client import UpstreamClient

__all__ = ["Gateway"]


@dataclass(frozen=True, slots=True)
class Gateway:
    """Everything a request needs under one policy: immutable, swapped whole on a reload; each
    request takes the one current at its start and keeps it to its end."""

    policy: Policy
    policy_hash: str
    services: Services
    keyring: Keyring
    pipeline: Pipeline
    telemetry: Telemetry
    pools: Pools
    prober: Prober
    counters: TokenCounters
    degrade: Degrade  # its rule choice also says which model's tokenizer count_tokens uses

    @classmethod
    def build(
        cls,
        policy: Policy,
        clock: Clock,
        transport: httpx.AsyncBaseTransport | None = None,
        store: QuotaStore | None = None,
        otel: OtelProviders | None = None,
        policy_hash: str = "",
        live: LiveGateway[Gateway] | None = None,
        counters: TokenCounters | None = None,
    ) -> Gateway:
        """The first gateway of a process, made `live`'s current one; `counters` as `assemble`'s."""
        serving: LiveGateway[Gateway] = live if live is not None else LiveGateway()
        services = Services.open(
            policy, clock, transport, store, otel, lambda: serving.current.policy
        )
        gateway = cls.assemble(policy, policy_hash, services, None, counters)
        serving.current = gateway
        return gateway

    @classmethod
    def assemble(
        cls,
        policy: Policy,
        policy_hash: str,
        services: Services,
        previous: Gateway | None,
        counters: TokenCounters | None = None,
    ) -> Gateway:
        """The per-policy objects on `services`; what the policy did not change is reused
        from `previous` (backend health and in-flight counts); `counters` are the policy's
        token counters (default: every tokenizer loaded here, as at startup)."""
        clock, storage, failures = services.clock, services.storage, services.storage_failures
        store = storage.quotas
        same_routing = previous is not None and (
            previous.policy.backends,
            previous.policy.models,
        ) == (policy.backends, policy.models)
        if previous is not None and same_routing:
            pools, prober = previous.pools, previous.prober
        else:  # a backend left as it was keeps its health (a dead one stays out)
            pools = Pools(policy, clock, previous.pools.health if previous is not None else None)
            prober = Prober(pools, services.upstream, policy.upstream.probe_interval)
        if counters is None:
            counters = TokenCounters(policy)
        keyring = Keyring(policy, services.keys)
        prices = PriceTable(policy)
        rate_limits, cache = services.rate_limits, services.cache
        # A quota's refusal shows the tenant's rate-limit headers too, as every answer does.
        budgets = Budgets(
            store, prices, clock, failures, refusing=rate_limits.show, unbooked=services.unbooked
        )
        key_limits = KeyAllowances(
            store, storage.limits, clock, failures, rate_limits.show, services.unbooked,
            true_ups=rate_limits.true_ups,
        )  # fmt: skip
        telemetry = Telemetry(policy, clock, services.metrics, tracing=services.tracing)
        shape = Shape(counters)
        attempts = Attempts(
            pools, services.upstream, clock, rate_limits.admit_backend,
            rate_limits.give_back_backend, Recount(shape, counters),
        )  # fmt: skip
        # The request path after auth. The stages say themselves whether they plan storage
        # steps (taken by the prefetch in one round trip), hold something until the request
        # ends (settled, last first), and are traced.
        # A runtime key's own allowance before the tenant's rate limits: a request it refuses
        # takes nothing from them (its refusals spent the tenant's requests_per_minute, and one
        # key kept over its own limit refused every other key of the tenant). The budget stays
        # first: a refusal it answers by shortening the request (stop_stream_at_budget) has
        # every stage take its steps again, and a step taken before it would be taken twice.
        inflight = SharedInflight(storage.limits, clock)
        degrade = Degrade(pools, clock, store, failures, cache, budgets.quotas, inflight)
        admission: list[Stage] = [budgets, key_limits, rate_limits, cache, degrade, Route(attempts)]
        # A rule's output bound is what the admission reserves, and the model it sends the
        # request to is the one whose tokenizer shaping counts with: chosen before both, where
        # any tenant has rules (a stage fewer a request where none has).
        choice = [DegradeChoice(degrade)] if any(t.degrade for t in policy.tenants.values()) else []
        stages: list[Stage] = [
            Parse(policy.models),
            StoredState(services.owned_ids, clock),
            Attribute(),
            *choice,
            shape,
            Prefetch(storage, planners_in(admission), failures),
            *admission,
        ]
        account = Account(
            clock, settlers_of(stages), prices, services.ledger, telemetry, counters=counters,
            models=policy.models,
        )  # fmt: skip
        checkpoint = Checkpoint(
            services.checkpoints, [budgets, key_limits], services.ledger, account.usage_record,
            prices, counters,
        )  # fmt: skip
        pipeline = Pipeline(
            auth=Authenticate(keyring, policy.tenants, key_limits.note),
            stages=[*stages, checkpoint],  # checkpoints bill what the account settles
            forward=Forward(attempts, clock, telemetry, policy.upstream),
            account=account,
            clock=clock,
            max_body_bytes=policy.server.max_body_bytes,
            telemetry=telemetry,
            replay=cache.replay,
            body_timeout_s=policy.server.body_timeout,
            drain=services.drain,
        )
        return cls(
            policy=policy, policy_hash=policy_hash, services=services, keyring=keyring,
            pipeline=pipeline, telemetry=telemetry, pools=pools, prober=prober, counters=counters,
            degrade=degrade,
        )  # fmt: skip

    async def reloaded(self, policy: Policy, policy_hash: str) -> Gateway:
        """The gateway of a reloaded policy, sharing what it did not change. Tokenizers already
        loaded are kept (by spec); a new one loads in a worker thread, so its download and file
        reads do not hold up the loop (building an HF tokenizer holds the GIL, so that part
        still does). TokenizerError if one cannot be loaded."""
        counters = self.counters
        if policy.models != self.policy.models:
            counters = await asyncio.to_thread(self.counters.reusing, policy)
        return self.assemble(policy, policy_hash, self.services, self, counters)

    @property
    def clock(self) -> Clock:
        return self.services.clock

    @property
    def upstream(self) -> UpstreamClient:
        return self.services.upstream

    @property
    def store(self) -> QuotaStore:
        return self.services.storage.quotas

    @property
    def ledger(self) -> Ledger | None:
        return self.services.ledger

    @property
    def storage_failures(self) -> StorageFailures:
        return self.services.storage_failures

    @property
    def started_wall(self) -> float:
        return self.services.started_wall

    @property
    def cache(self) -> ResponseCache:
        return self.services.cache

    async def start(self) -> None:
        await self.services.start()
        self.prober.start()

    async def aclose(self) -> None:
        try:
            await bounded("the backend prober", self.prober.aclose())
        finally:
            await self.services.aclose()
