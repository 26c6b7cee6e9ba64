"""What outlives a policy reload, built once per process: storage, the ledger, the upstream pool,
telemetry's metrics, the rate limiter's queues, runtime keys, the drain; and their bounded close."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import httpx
from opentelemetry.trace import TracerProvider

from proxy.asgi.drain import Drain
from proxy.cache import open_embedder
from proxy.clock import Clock
from proxy.keys.kept import KeptKeys
from proxy.keys.runtime import RuntimeKeys
from proxy.ledger import Ledger, open_ledger
from proxy.policy import Policy
from proxy.stages.cache import ResponseCache
from proxy.stages.checkpoint import CheckpointSweep
from proxy.stages.ratelimit import RateLimits
from proxy.stages.storagepolicy import StorageFailures
from proxy.stages.unbooked import Unbooked
from proxy.storage import QuotaStore, Storage, open_storage
from proxy.storage.cache import CacheStore
from proxy.storage.keys import open_key_store
from proxy.storage.owned import OwnedIds, open_owned_ids
from proxy.storage.sessions import EndedSessions, open_ended_sessions
from proxy.telemetry.budgets import budgets_left
from proxy.telemetry.metrics import BudgetLeft, GatewayMetrics
from proxy.telemetry.traces import CountsDrops, TraceSource
from proxy.telemetry.tracing import open_tracing
from proxy.telemetry.workershare import WorkerShare
from proxy.upstream.client import UpstreamClient

__all__ = [
    "MetricsPusher",
    "OtelProviders",
    "Services",
    "TracesOnly",
    "bounded",
    "otel_providers",
    "response_cache",
]

_log = logging.getLogger("tokenweir")


@dataclass(frozen=True, slots=True)
class Services:
    """What outlives a policy reload: storage, ledger, the upstream pool, telemetry's metrics,
    the rate limiter's queues, runtime keys and the drain. Built once per process."""

    clock: Clock
    upstream: UpstreamClient
    storage: Storage
    ledger: Ledger | None
    storage_failures: StorageFailures
    started_wall: float
    metrics: GatewayMetrics
    tracing: TraceSource | None
    cache: ResponseCache
    rate_limits: RateLimits
    drain: Drain
    keys: RuntimeKeys
    ended_sessions: EndedSessions
    owned_ids: OwnedIds  # which tenant made each stored response
    metrics_push: MetricsPusher | None = None
    checkpoints: CheckpointSweep = field(default_factory=CheckpointSweep)
    unbooked: Unbooked | None = None  # quota settles storage did not take, sent again

    @classmethod
    def open(
        cls,
        policy: Policy,
        clock: Clock,
        transport: httpx.AsyncBaseTransport | None = None,
        store: QuotaStore | None = None,
        otel: OtelProviders | None = None,
        current_policy: Callable[[], Policy] | None = None,
    ) -> Services:
        """`current_policy` is the policy serving now (after reloads), for the budgets the
        metrics export reads; `policy` if not given."""
        storage = open_storage(policy.storage)
        if store is not None:
            storage = storage.with_quotas(store)
        failures = StorageFailures(clock)
        tracer_provider = otel.tracer_provider if otel else None
        metrics = GatewayMetrics(WorkerShare.from_environment())  # --workers N: summed
        ledger = None
        if policy.ledger:  # on the storage's link when on the storage's Redis
            ledger = open_ledger(policy.ledger, storage_url=policy.storage, link=storage.link)
        if ledger is not None:
            metrics.watch_ledger(ledger.stats)
        if isinstance(tracer_provider, CountsDrops):  # tokenweir's own OTLP export
            metrics.watch_spans(tracer_provider.dropped_spans)
        serving = current_policy or (lambda: policy)
        quotas = storage.quotas
        unbooked = Unbooked(quotas, clock.wall)
        metrics.watch_unbooked(unbooked.stats)
        rate_limits = RateLimits(storage.limits, clock, failures, serving)
        metrics.watch_true_ups(rate_limits.true_ups.stats)
        return cls(
            clock, UpstreamClient(policy.upstream, transport), storage,
            ledger, failures, clock.wall(), metrics,
            open_tracing(tracer_provider) if tracer_provider else None,
            response_cache(policy, clock, storage.cache, serving),
            rate_limits,
            Drain(policy.server.drain_timeout),
            RuntimeKeys(
                open_key_store(policy.storage, storage.link), clock,
                kept=KeptKeys.from_environment(),
            ),
            open_ended_sessions(storage), open_owned_ids(storage),
            otel.metrics_push(
                metrics, lambda: budgets_left(serving(), quotas, clock.wall())
            ) if otel else None,
            unbooked=unbooked,
        )  # fmt: skip

    async def start(self) -> None:
        if self.ledger is not None:
            await self.ledger.start()
        await self.keys.start()
        self.drain.install()
        if self.metrics_push is not None:
            self.metrics_push.start()

    async def aclose(self) -> None:
        """Close in dependency order; the ledger last, so every settled request is flushed, and
        after it the storage's link, which the ledger and runtime keys may ride on: one close."""
        self.drain.uninstall()
        try:
            await bounded("checkpoints", self.checkpoints.aclose())
            if self.metrics_push is not None:  # first: its last export reads budgets
                await bounded("the metrics export", self.metrics_push.aclose())
            await bounded("runtime keys", self.keys.aclose())
            await bounded("ended sessions", self.ended_sessions.aclose())
            await bounded("stored-object owners", self.owned_ids.aclose())
            if self.unbooked is not None:  # before the quota store closes: its last send
                await bounded("quota settles kept", self.unbooked.aclose())
            await bounded("storage undo tasks", self.storage_failures.aclose())
            await bounded("token-bucket true-ups kept", self.rate_limits.true_ups.aclose())
            await bounded("the upstream pool", self.upstream.aclose())
            await bounded("the quota store", self.storage.quotas.aclose())
            await bounded("the limit store", self.storage.limits.aclose())
            await bounded("the response cache", self.cache.aclose())
        finally:
            try:
                if self.ledger is not None:
                    await self.ledger.aclose()
                self.metrics.publish_last()  # what the ledger wrote last included
            finally:  # after the ledger: a Redis ledger on the storage's Redis writes on its link
                await bounded("the storage connection", self.storage.aclose())


_CLOSE_TIMEOUT_S = 3.0


async def bounded(what: str, closing: Awaitable[None]) -> None:
    """One step of shutdown, bounded: a close that hangs is logged and left behind, so the
    process still exits and the steps after it (the ledger's flush above all) still run."""
    try:
        async with asyncio.timeout(_CLOSE_TIMEOUT_S):
            await closing
    except TimeoutError:
        _log.error("shutdown: closing %s took over %.0f s; left behind", what, _CLOSE_TIMEOUT_S)


def response_cache(
    policy: Policy, clock: Clock, store: CacheStore, serving: Callable[[], Policy] | None = None
) -> ResponseCache:
    """The response cache; its embedder and verifier call the backends of `serving()`, the
    policy serving now (a reload may move a backend), else of `policy`."""
    current = serving or (lambda: policy)
    semantic = [name for name, t in policy.tenants.items() if t.cache.mode == "semantic"]
    if semantic and policy.embedder is None:
        _log.warning(
            "tenants %s ask for the semantic cache but the policy has no embedder: section; "
            "they get the exact cache only",
            ", ".join(semantic),
        )
    timeout_s = policy.embedder.timeout if policy.embedder else 0.0
    return ResponseCache(
        store, clock, open_embedder(policy, current), embed_timeout_s=timeout_s,
        backends=lambda: current().backends,
    )  # fmt: skip


class MetricsPusher(Protocol):
    """Exports the gateway's metrics on its own schedule while the gateway runs."""

    def start(self) -> None: ...

    async def aclose(self) -> None: ...


class OtelProviders(Protocol):
    """OpenTelemetry for the gateway: a tracer provider and a metrics export, either may be
    None (that signal is off)."""

    @property
    def tracer_provider(self) -> TracerProvider | None: ...

    def metrics_push(
        self, metrics: GatewayMetrics, budgets: Callable[[], Awaitable[Sequence[BudgetLeft]]]
    ) -> MetricsPusher | None: ...


@dataclass(frozen=True, slots=True)
class TracesOnly:
    """A bare tracer provider given as `create_app(otel=...)`: its traces, no metrics push."""

    tracer_provider: TracerProvider

    def metrics_push(
        self, metrics: GatewayMetrics, budgets: Callable[[], Awaitable[Sequence[BudgetLeft]]]
    ) -> MetricsPusher | None:
        return None


def otel_providers(otel: OtelProviders | TracerProvider | None) -> OtelProviders | None:
    """`otel` as the gateway takes it: a tracer provider alone (the SDK's or any other API
    implementation) failed the gateway's startup, having no `tracer_provider` of its own."""
    return TracesOnly(otel) if isinstance(otel, TracerProvider) else otel
