"""The app factory: resolve the policy once, build collaborators in the lifespan, mount the routes.

`uvicorn --factory proxy.app:create_app` reads the policy named by TOKENWEIR_CONFIG
(default: the embedded policies/default.yaml).
"""

from __future__ import annotations

import gc
import logging
import os
import secrets
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route
from starlette.types import ASGIApp
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from proxy.accepted import AcceptedPolicy
from proxy.apis.anthropic import anthropic_error
from proxy.clock import Clock, SystemClock
from proxy.errors import BadRequest, GatewayError, InternalError, NotFound
from proxy.gateway import Gateway
from proxy.keys.offboard import revoke_removed_tenants
from proxy.ledger import LedgerError
from proxy.orphan import end_with_supervisor, leave_if_orphaned
from proxy.policy import Policy, load_policy
from proxy.reload import (
    SUPERVISOR_ENV,
    WATCH_ENV,
    CurrentGateway,
    LiveGateway,
    PolicySource,
    Reloader,
    policy_digest,
)
from proxy.services import OtelProviders, bounded, otel_providers
from proxy.stages.auth import CurrentKeyring
from proxy.storage import (
    QuotaStore,
)
from proxy.telemetry.logs import flush_access_log
from proxy.telemetry.otelenv import otel_wanted
from proxy.tokens import TokenCounter, TokenCounters
from proxy.web.admin import admin_routes
from proxy.web.agents import CountTokens, MessagesEndpoint
from proxy.web.dashboard import DashboardPages
from proxy.web.fastlane import LanedStarlette
from proxy.web.openai import ModelList, OpenAIEndpoint
from proxy.web.ops import Health, Metrics, Ready
from proxy.web.requestid import REQUEST_ID_KEY, RequestId
from proxy.web.session import Sessions
from proxy.web.startup import CannotStart
from proxy.web.usage import UsageApi

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

    from proxy.telemetry.sdk import OtelSdk

__all__ = [
    "DEFAULT_POLICY",
    "SESSION_SECRET_ENV",
    "OtelProviders",
    "create_app",
    "create_served_app",
]

DEFAULT_POLICY = Path(__file__).parent / "policies" / "default.yaml"
SESSION_SECRET_ENV = "TOKENWEIR_SESSION_SECRET"  # noqa: S105 - a variable name, not a secret
SESSION_TTL_S = 12 * 3600.0
_log = logging.getLogger("tokenweir")
_MESSAGES = "/v1/messages"  # Anthropic's routes: their errors in its shape
_SERVER_METHODS = "GET, HEAD, POST, DELETE, OPTIONS"  # what some route of the gateway takes
SERVING_GC_THRESHOLDS = (5000, 20, 20)
"""The collector's thresholds in a serving process (CPython's are 700, 10, 10). With tens of
requests in flight, most of what the young generation holds when it fills belongs to requests
still running: at 700 it was collected about once every five requests, and each time its
survivors moved on to be traversed again in the older generations, about a tenth of the all-on
gateway's CPU. Measured in docs/benchmarks.md (issue 16's "four small cuts": the collector's
thresholds)."""


def create_app(
    policy: Policy | None = None,
    *,
    config: Path | None = None,
    watch: bool | None = None,
    clock: Clock | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    store: QuotaStore | None = None,
    otel: OtelProviders | TracerProvider | None = None,
    freeze_gc: bool = False,
    tokenizers: Mapping[str | None, TokenCounter] | None = None,
    source: PolicySource | None = None,
) -> Starlette:
    """The gateway app; `clock`, `transport` and `store` replace the real ones (for tests).

    The policy is `policy`, else the file `config`, else TOKENWEIR_CONFIG's (default: the
    embedded one); a file can be reloaded (SIGHUP, `POST /admin/reload`, and with `watch`, or
    TOKENWEIR_WATCH=1, when it changes). `otel` gives tracer/meter providers (or is a tracer
    provider, for traces alone); without it, the
    OTEL_* environment may configure the SDK here, in the process (each uvicorn worker) that
    serves the app. `freeze_gc` moves what startup built out of the garbage collector's way
    (`gc.freeze`) and collects less often (SERVING_GC_THRESHOLDS), for a serving process.
    `tokenizers`: some already loaded, by spec (`load_tokenizers`), not loaded again. `source`:
    the file `config` as the command read it (a FIFO, `--config <(...)`, gives its bytes once)."""
    if policy is None:
        config = config or Path(os.environ.get("TOKENWEIR_CONFIG") or DEFAULT_POLICY)
    accepted = AcceptedPolicy.from_environment()  # under `tokenweir serve --workers N`
    if source is None and config is not None:
        source = PolicySource.starting(config, accepted)
    resolved = policy or (source.policy if source else load_policy(DEFAULT_POLICY))
    chosen_clock = clock or SystemClock()
    watching = watch if watch is not None else os.environ.get(WATCH_ENV) == "1"
    # Workers and replicas that share the secret accept each other's dashboard logins.
    secret = os.environ.get(SESSION_SECRET_ENV, "").encode() or secrets.token_bytes(32)
    live = _LiveGateway()
    # Bearer keys on the dashboard and /api/usage follow reloads and runtime keys; a session
    # cookie is checked against the keys of the policy serving now.
    keyring = CurrentKeyring(lambda: live.current.keyring)
    sessions = Sessions(lambda: live.current.policy, keyring, secret, SESSION_TTL_S)
    pages = DashboardPages(sessions)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        providers = otel_providers(otel)
        sdk = _start_otel_sdk() if providers is None else None
        digest = source.digest if source else policy_digest(resolved)
        counters = TokenCounters(resolved, loaded=tokenizers) if tokenizers else None
        gateway = Gateway.build(
            resolved, chosen_clock, transport, store, providers or sdk, digest, live, counters
        )
        try:
            await gateway.start()
        except LedgerError as exc:  # its file a directory, read-only, on a full disk, ...
            raise CannotStart(f"tokenweir cannot start: {exc}") from None
        gateway.services.metrics.serving(digest)
        reloader = Reloader(
            live, source, watch=watching, accepted=accepted,
            counted=gateway.services.metrics.policy_reloaded,
        )  # fmt: skip
        reloader.start()
        if freeze_gc:
            # Everything built so far lives as long as the process: keep it out of the
            # collector's full passes, which otherwise pause every stream for 35-60 ms.
            gc.collect()
            gc.freeze()
            gc.set_threshold(*SERVING_GC_THRESHOLDS)
        try:
            yield {"gateway": gateway, "live": live, "reloader": reloader}
        finally:
            try:
                await bounded("the policy reloader", reloader.aclose())
                await live.current.aclose()
            finally:
                flush_access_log()
                if sdk is not None:
                    sdk.shutdown()
                supervisor = os.environ.get(SUPERVISOR_ENV, "")
                if supervisor.isdigit():  # a worker of `serve --workers N`
                    leave_if_orphaned(int(supervisor))

    inference: dict[str, ASGIApp] = {
        "/v1/chat/completions": OpenAIEndpoint("chat"),
        "/v1/completions": OpenAIEndpoint("text_completion"),
        "/v1/embeddings": OpenAIEndpoint("embeddings"),
        "/v1/responses": OpenAIEndpoint("responses"),
        _MESSAGES: MessagesEndpoint(),
        "/v1/messages/count_tokens": CountTokens(),
    }
    app = LanedStarlette(
        lanes=inference,  # the same endpoints, past the middleware and the router
        routes=[
            *(Route(path, endpoint, methods=["POST"]) for path, endpoint in inference.items()),
            Route("/v1/models", ModelList(), methods=["GET"]),
            Route("/v1/models/{model_id:path}", ModelList(), methods=["GET"]),
            Route("/healthz", Health(), methods=["GET"]),
            Route("/readyz", Ready(), methods=["GET"]),
            Route("/metrics", Metrics(), methods=["GET"]),
            Route("/api/usage", UsageApi(sessions), methods=["GET"]),
            *admin_routes(),
            Route("/dashboard", pages.route("overview"), methods=["GET"]),
            Route("/dashboard/tenants/{name:path}", pages.route("tenant"), methods=["GET"]),
            Route("/dashboard/login", pages.route("login_form"), methods=["GET"]),
            Route("/dashboard/login", pages.route("login"), methods=["POST"]),
            Route("/dashboard/logout", pages.route("logout"), methods=["POST"]),
            Route("/dashboard/static/dashboard.css", pages.route("stylesheet"), methods=["GET"]),
        ],
        middleware=[
            # uvicorn's own, here instead of around the whole app (`tokenweir serve` turns
            # uvicorn's off): only the dashboard reads the scheme (its cookie's `Secure`), and
            # the inference lane should not pay for it on every request.
            Middleware(ProxyHeadersMiddleware, trusted_hosts=_forwarded_allow_ips()),
            Middleware(CurrentGateway),
            Middleware(RequestId),
        ],
        exception_handlers={HTTPException: _http_error, Exception: _unexpected},
        lifespan=lifespan,
    )
    # A path with a trailing slash is a 404 that names the route (`_http_error`), not a bare
    # 307 to the path without it: a client that follows it resends a POST to the Host header's
    # name over plain http (with no key, behind a TLS proxy).
    app.router.redirect_slashes = False
    return app


class _LiveGateway(LiveGateway[Gateway]):
    """The gateway new requests get; a reload's swap that drops a tenant also revokes its
    runtime keys (on every replica sharing the storage)."""

    async def swap(self, new: Gateway) -> None:
        old = self.current
        await super().swap(new)
        new.services.metrics.serving(new.policy_hash)
        await revoke_removed_tenants(new.services.keys, old.policy, new.policy)


def _forwarded_allow_ips() -> str:
    """Whose `X-Forwarded-Proto` and `X-Forwarded-For` are believed: uvicorn's setting and
    default (FORWARDED_ALLOW_IPS, else the loopback addresses)."""
    return os.environ.get("FORWARDED_ALLOW_IPS", "127.0.0.1,::1")


def create_served_app(
    tokenizers: Mapping[str | None, TokenCounter] | None = None,
    source: PolicySource | None = None,
) -> Starlette:
    """What `tokenweir serve` runs in each worker: the policy from TOKENWEIR_CONFIG, and the
    startup heap frozen; `tokenizers` and `source` those the command loaded already (one
    process). A worker (SUPERVISOR_ENV names its supervisor) drains and exits if the
    supervisor dies."""
    supervisor = os.environ.get(SUPERVISOR_ENV, "")
    if supervisor.isdigit():
        end_with_supervisor(int(supervisor))
    return create_app(freeze_gc=True, tokenizers=tokenizers, source=source)


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
    if request.scope["path"] == "*":  # no route has it: answered here, off the request path
        return _asterisk(request.method)
    if status == 404:
        error: GatewayError = NotFound(
            f"Unknown request URL: {request.method} {request.url.path}.{_slash_hint(request)}"
        )
    else:
        error = GatewayError(f"{request.method} is not allowed on {request.url.path}.")
        error.status, error.type, error.code = status, "invalid_request_error", "method_not_allowed"
    # A 405's `Allow` (the route's methods), which a 405 must carry.
    headers = exc.headers if isinstance(exc, HTTPException) else None
    return _render(error, request, headers)


def _asterisk(method: str) -> Response:
    """`OPTIONS *` asks about the server as a whole (RFC 9110 9.3.7): what methods it takes.
    Any other method may not name `*` (RFC 9112 3.2.4)."""
    if method == "OPTIONS":
        return Response(status_code=200, headers={"allow": _SERVER_METHODS})
    error = BadRequest(
        f"{method} * names no resource: only OPTIONS may ask about the server as a whole.",
        code="invalid_request_target",
    )
    return _render(error)


def _slash_hint(request: Request) -> str:
    """Where a path with a trailing slash names a route without it, a sentence that says so."""
    path = request.url.path
    bare = path.rstrip("/")
    if not bare or bare == path:
        return ""
    scope = {**request.scope, "path": bare}
    if any(route.matches(scope)[0] is not Match.NONE for route in request.app.router.routes):
        return f" The route is {bare}, without the trailing slash."
    return ""


async def _unexpected(request: Request, exc: Exception) -> Response:
    _log.exception("unexpected error on %s %s", request.method, request.url.path)
    error = InternalError("The gateway hit an unexpected error; it has been logged.")
    return _render(error, request)


def _render(
    error: GatewayError, request: Request | None = None, headers: Mapping[str, str] | None = None
) -> Response:
    """The error in OpenAI's shape, or Anthropic's on the Messages routes (where a 404, a 405
    or an error no stage caught reaches this handler past the routes' own wrapper), with the
    request id as Anthropic's `request-id` too."""
    status, body, shown = error.status, error.to_json(), {**error.headers(), **(headers or {})}
    path = request.url.path if request is not None else "*"
    if path == _MESSAGES or path.startswith(_MESSAGES + "/"):
        status, body = anthropic_error(status, body)
        request_id = request.scope.get(REQUEST_ID_KEY) if request is not None else None
        if request_id:
            shown["request-id"] = request_id
    return Response(body, status_code=status, media_type="application/json", headers=shown)
