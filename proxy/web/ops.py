"""Operations routes: liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

import orjson
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import QueryParams
from starlette.types import Receive, Scope, Send

from proxy.asgi.respond import send_json
from proxy.ledger.base import LedgerError
from proxy.storage import StorageError
from proxy.telemetry.budgets import budgets_left

if TYPE_CHECKING:
    from proxy.gateway import Gateway

__all__ = ["Health", "Metrics", "Ready"]

_PROBE_TIMEOUT_S = 2.0
_NOT_READY_RETRY = (b"retry-after", b"5")
"""DESIGN gives every 503 a Retry-After; a not-ready answer may change with the next probe."""


class Health:
    """`GET /healthz`: the process is up and answering."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, b'{"status":"ok"}')


class Ready:
    """`GET /readyz`: 200 when every model has a backend answering `GET /models` and the shared
    storage answers, and not while shutting down; the body also counts what was decided while
    storage was failing, names the policy version serving (`policy_hash`), and gives this
    process's ledger figures, its quota settles and token-bucket true-ups kept to send again
    (held while its store is down: informative, not a reason to take the gateway out of
    rotation).
    `GET /readyz?backends=skip` leaves the backends out: this gateway can serve (its policy is
    loaded, storage answers, not draining), for orchestrators whose readiness must not follow
    backend health, which decides routing instead."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gateway: Gateway = scope["state"]["gateway"]
        skip = QueryParams(scope["query_string"]).get("backends") == "skip"
        backends = () if skip else gateway.policy.backends
        storage, evicting, *results = await asyncio.gather(
            _storage_problem(gateway),
            _ledger_evicting(gateway),
            *(gateway.upstream.probe(b, _PROBE_TIMEOUT_S) for b in backends),
        )
        problems = {b.name: r for b, r in zip(backends, results, strict=True) if r is not None}
        unserved = [
            model
            for model in gateway.policy.models
            if not skip and all(b.name in problems for b in gateway.policy.backends_for(model))
        ]
        draining = gateway.pipeline.drain.draining
        ready = not unserved and storage is None and not draining
        body: dict[str, object] = {
            "status": "ready" if ready else "not ready",
            "backends": {
                b.name: "not probed" if skip else problems.get(b.name, "ok")
                for b in gateway.policy.backends
            },
            "models_without_backend": unserved,
            "storage": storage or "ok",
            "storage_failure_decisions": dict(gateway.storage_failures.counts),
            "draining": draining,
            "policy_hash": gateway.policy_hash,
            "pid": os.getpid(),  # which worker answered, under `serve --workers N`
        }
        ledger = gateway.ledger
        if ledger is not None:  # this process's: a ledger whose store is down serves on
            stats = ledger.stats()
            body["ledger"] = {  # counts only: its errors are in the log (no key reads this)
                "written": stats.written, "dropped": stats.dropped, "buffered": stats.buffered,
                "write_failures": stats.write_failures, "evicting": evicting,
            }  # fmt: skip
        unbooked = gateway.services.unbooked
        if unbooked is not None:  # this process's quota settles storage did not take
            body["quota_settles"] = unbooked.stats()
        # and its token-bucket true-ups storage did not take
        body["token_true_ups"] = gateway.services.rate_limits.true_ups.stats()
        if ready:
            await send_json(send, 200, orjson.dumps(body))
        else:
            await send_json(send, 503, orjson.dumps(body), (_NOT_READY_RETRY,))


class Metrics:
    """`GET /metrics`: the server's metrics in the Prometheus text format, under `--workers N`
    every worker's summed (no key needed; the labels are tenant, model, backend and status
    class, never users or request ids)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gateway: Gateway = scope["state"]["gateway"]
        budgets = await budgets_left(gateway.policy, gateway.store, gateway.clock.wall())
        body = gateway.telemetry.metrics.render(budgets)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", CONTENT_TYPE_LATEST.encode()),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body, "more_body": False})


async def _storage_problem(gateway: Gateway) -> str | None:
    try:
        async with asyncio.timeout(_PROBE_TIMEOUT_S):
            await gateway.store.ping()
    except (StorageError, TimeoutError) as exc:
        return str(exc) or type(exc).__name__
    return None


async def _ledger_evicting(gateway: Gateway) -> str | None:
    """The ledger store's eviction policy, if it has one; None too when it cannot be asked
    (its write failures say so)."""
    if gateway.ledger is None:
        return None
    try:
        async with asyncio.timeout(_PROBE_TIMEOUT_S):
            return await gateway.ledger.evicting()
    except (LedgerError, TimeoutError):
        return None
