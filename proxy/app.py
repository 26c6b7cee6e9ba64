"""The app factory: resolve the policy once, build collaborators in the lifespan, mount the routes.

`uvicorn --factory proxy.app:create_app` reads the policy named by TOKENWEIR_CONFIG
(default: the embedded policies/default.yaml).
"""

from __future__ import annotations

import gc
import logging
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx
from opentelemetry.trace import TracerProvider
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy.cache import open_embedder
from proxy.clock import Clock, SystemClock
from proxy.cost import PriceTable
from proxy.errors import GatewayError, InternalError, NotFound
from proxy.ledger import Ledger, open_ledger
from proxy.pipeline import Pipeline
from proxy.policy import Policy, load_policy
from proxy.routing import Pools, Prober
from proxy.stages.account import Account
from proxy.stages.auth import Authenticate, Keyring
from proxy.stages.budget import Budgets
from proxy.stages.cache import ResponseCache
from proxy.stages.degrade import Degrade
from proxy.stages.forward import Forward
from proxy.stages.parse import Parse
from proxy.stages.ratelimit import BackendLimits, RateLimits
from proxy.stages.route import Route as RouteStage
from proxy.stages.shape import Shape
from proxy.stages.storagepolicy import StorageFailures
from proxy.storage import (
    LimitStore,
    QuotaStore,
    open_cache_store,
    open_limit_store,
    open_store,
)
from proxy.telemetry.budgets import budgets_left
from proxy.telemetry.metrics import BudgetLeft, GatewayMetrics
from proxy.telemetry.otelenv import otel_wanted
from proxy.telemetry.recorder import Telemetry
from proxy.telemetry.tracing import Tracing
from proxy.tokens import TokenCounters
from proxy.upstream.client import UpstreamClient
from proxy.web.dashboard import DashboardPages
from proxy.web.drain import Drain
from proxy.web.openai import ModelList, OpenAIEndpoint
from proxy.web.ops import Health, Metrics, Ready
from proxy.web.requestid import RequestId
from proxy.web.session import Sessions
from proxy.web.usage import UsageApi

if TYPE_CHECKING:
    from proxy.telemetry.sdk import OtelSdk

__all__ = [
    "DEFAULT_POLICY",
    "SESSION_SECRET_ENV",
    "Gateway",
    "OtelProviders",
    "create_app",
    "create_served_app",
]

DEFAULT_POLICY = Path(__file__).parent / "policies" / "default.yaml"
SESSION_SECRET_ENV = "TOKENWEIR_SESSION_SECRET"  # noqa: S105 - a variable name, not a secret
SESSION_TTL_S = 12 * 3600.0
_log = logging.getLogger("tokenweir")


@dataclass(frozen=True, slots=True)
class Gateway:
    """Everything a request needs, built once per process in the lifespan."""

    policy: Policy
    clock: Clock
    keyring: Keyring
    upstream: UpstreamClient
    store: QuotaStore
    limit_store: LimitStore
    ledger: Ledger | None
    pipeline: Pipeline
    storage_failures: StorageFailures
    started_wall: float
    telemetry: Telemetry
    cache: ResponseCache
    pools: Pools
    prober: Prober
    metrics_push: MetricsPusher | None = None

    @classmethod
    def build(
        cls,
        policy: Policy,
        clock: Clock,
        transport: httpx.AsyncBaseTransport | None = None,
        store: QuotaStore | None = None,
        otel: OtelProviders | None = None,
    ) -> Gateway:
        keyring = Keyring(policy)
        upstream = UpstreamClient(policy.upstream, transport)
        store = store or open_store(policy.storage)
        prices = PriceTable(policy)
        failures = StorageFailures(clock)
        budgets = Budgets(store, prices, clock, failures)
        limit_store = open_limit_store(policy.storage)
        rate_limits = RateLimits(limit_store, clock, failures)
        ledger = open_ledger(policy.ledger, storage_url=policy.storage) if policy.ledger else None
        telemetry = _telemetry(policy, clock, otel)
        cache = _response_cache(policy, clock)
        pools = Pools(policy, clock)
        route = RouteStage(pools, upstream, clock, rate_limits.admit_backend)
        pipeline = Pipeline(
            auth=Authenticate(keyring, policy.tenants),
            stages=[
                Parse(policy.models),
                Shape(TokenCounters(policy)),
                budgets,
                rate_limits,
                cache,
                Degrade(pools, clock, store, failures, cache),
                route,
                BackendLimits(rate_limits),
            ],
            forward=Forward(route, clock, telemetry, policy.upstream),
            account=Account(clock, [route, rate_limits, budgets, cache], prices, ledger, telemetry),
            max_body_bytes=policy.server.max_body_bytes,
            telemetry=telemetry,
            replay=cache.replay,
            body_timeout_s=policy.server.body_timeout,
            drain=Drain(policy.server.drain_timeout),
        )
        return cls(
            policy, clock, keyring, upstream, store, limit_store, ledger, pipeline, failures,
            clock.wall(), telemetry, cache, pools,
            Prober(pools, upstream, policy.upstream.probe_interval),
            otel.metrics_push(
                telemetry.metrics, lambda: budgets_left(policy, store, clock.wall())
            ) if otel else None,
        )  # fmt: skip

    async def start(self) -> None:
        if self.ledger is not None:
            await self.ledger.start()
        self.prober.start()
        self.pipeline.drain.install()
        if self.metrics_push is not None:
            self.metrics_push.start()

    async def aclose(self) -> None:
        """Close in dependency order; the ledger last, so every settled request is flushed."""
        self.pipeline.drain.uninstall()
        try:
            if self.metrics_push is not None:  # first: its last export reads budgets
                await self.metrics_push.aclose()
            await self.storage_failures.aclose()
            await self.prober.aclose()
            await self.upstream.aclose()
            await self.store.aclose()
            await self.limit_store.aclose()
            await self.cache.aclose()
        finally:
            if self.ledger is not None:
                await self.ledger.aclose()


def _response_cache(policy: Policy, clock: Clock) -> ResponseCache:
    semantic = [name for name, t in policy.tenants.items() if t.cache.mode == "semantic"]
    if semantic and policy.embedder is None:
        _log.warning(
            "tenants %s ask for the semantic cache but the policy has no embedder: section; "
            "they get the exact cache only",
            ", ".join(semantic),
        )
    timeout_s = policy.embedder.timeout if policy.embedder else 0.0
    store = open_cache_store(policy.storage)
    return ResponseCache(store, clock, open_embedder(policy), embed_timeout_s=timeout_s)


def create_app(
    policy: Policy | None = None,
    *,
    clock: Clock | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    store: QuotaStore | None = None,
    otel: OtelProviders | None = None,
    freeze_gc: bool = False,
) -> Starlette:
    """The gateway app; `clock`, `transport` and `store` replace the real ones (for tests).

    `otel` gives tracer/meter providers; without it, the OTEL_* environment may configure the
    SDK here, in the process (each uvicorn worker) that serves the app. `freeze_gc` moves what
    startup built out of the garbage collector's way (`gc.freeze`), for a serving process."""
    resolved = policy or load_policy(os.environ.get("TOKENWEIR_CONFIG") or DEFAULT_POLICY)
    chosen_clock = clock or SystemClock()
    # Workers and replicas that share the secret accept each other's dashboard logins.
    secret = os.environ.get(SESSION_SECRET_ENV, "").encode() or secrets.token_bytes(32)
    sessions = Sessions(resolved, Keyring(resolved), secret, SESSION_TTL_S)
    pages = DashboardPages(sessions)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        sdk = _start_otel_sdk() if otel is None else None
        gateway = Gateway.build(resolved, chosen_clock, transport, store, otel or sdk)
        await gateway.start()
        if freeze_gc:
            # Everything built so far lives as long as the process: keep it out of the
            # collector's full passes, which otherwise pause every stream for 35-60 ms.
            gc.collect()
            gc.freeze()
        try:
            yield {"gateway": gateway}
        finally:
            try:
                await gateway.aclose()
            finally:
                if sdk is not None:
                    sdk.shutdown()

    return Starlette(
        routes=[
            Route("/v1/chat/completions", OpenAIEndpoint("chat"), methods=["POST"]),
            Route("/v1/completions", OpenAIEndpoint("text_completion"), methods=["POST"]),
            Route("/v1/embeddings", OpenAIEndpoint("embeddings"), methods=["POST"]),
            Route("/v1/models", ModelList(), methods=["GET"]),
            Route("/healthz", Health(), methods=["GET"]),
            Route("/readyz", Ready(), methods=["GET"]),
            Route("/metrics", Metrics(), methods=["GET"]),
            Route("/api/usage", UsageApi(sessions), methods=["GET"]),
            Route("/dashboard", pages.route("overview"), methods=["GET"]),
            Route("/dashboard/tenants/{name:path}", pages.route("tenant"), methods=["GET"]),
            Route("/dashboard/login", pages.route("login_form"), methods=["GET"]),
            Route("/dashboard/login", pages.route("login"), methods=["POST"]),
            Route("/dashboard/logout", pages.route("logout"), methods=["POST"]),
            Route("/dashboard/static/dashboard.css", pages.route("stylesheet"), methods=["GET"]),
        ],
        middleware=[Middleware(RequestId)],
        exception_handlers={HTTPException: _http_error, Exception: _unexpected},
        lifespan=lifespan,
    )


def create_served_app() -> Starlette:
    """What `tokenweir serve` runs in each worker: the policy from TOKENWEIR_CONFIG, and the
    startup heap frozen."""
    return create_app(freeze_gc=True)


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


def _telemetry(policy: Policy, clock: Clock, otel: OtelProviders | None) -> Telemetry:
    tracer_provider = otel.tracer_provider if otel else None
    return Telemetry(
        policy,
        clock,
        GatewayMetrics(),
        tracing=Tracing(tracer_provider) if tracer_provider else None,
    )


def _start_otel_sdk() -> OtelSdk | None:
    """The SDK, if OTEL_* asks for it: imported only then, since it is the optional `otel` extra."""
    if not otel_wanted(os.environ):
        return None
    try:
        from proxy.telemetry.sdk import start_sdk
    except ImportError as exc:
        raise RuntimeError(
            "OTEL_* asks for OpenTelemetry export: pip install 'tokenweir[otel]'"
        ) from exc
    return start_sdk(os.environ)


async def _http_error(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    if status == 404:
        error: GatewayError = NotFound(f"Unknown request URL: {request.method} {request.url.path}.")
    else:
        error = GatewayError(f"{request.method} is not allowed on {request.url.path}.")
        error.status, error.type, error.code = status, "invalid_request_error", "method_not_allowed"
    return _render(error)


async def _unexpected(request: Request, exc: Exception) -> Response:
    _log.exception("unexpected error on %s %s", request.method, request.url.path)
    return _render(InternalError("The gateway hit an unexpected error; it has been logged."))


def _render(error: GatewayError) -> Response:
    return Response(
        error.to_json(),
        status_code=error.status,
        media_type="application/json",
        headers=error.headers(),
    )
