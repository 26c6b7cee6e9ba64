"""Operations routes: liveness and readiness."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import orjson
from starlette.types import Receive, Scope, Send

from proxy.web.respond import send_json

if TYPE_CHECKING:
    from proxy.app import Gateway

__all__ = ["Health", "Ready"]

_PROBE_TIMEOUT_S = 2.0


class Health:
    """`GET /healthz`: the process is up and answering."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, b'{"status":"ok"}')


class Ready:
    """`GET /readyz`: 200 when every model has at least one backend answering `GET /models`."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gateway: Gateway = scope["state"]["gateway"]
        backends = gateway.policy.backends
        results = await asyncio.gather(
            *(gateway.upstream.probe(b, _PROBE_TIMEOUT_S) for b in backends)
        )
        problems = {b.name: r for b, r in zip(backends, results, strict=True) if r is not None}
        unserved = [
            model
            for model in gateway.policy.models
            if all(b.name in problems for b in gateway.policy.backends_for(model))
        ]
        body = {
            "status": "not ready" if unserved else "ready",
            "backends": {b.name: problems.get(b.name, "ok") for b in backends},
            "models_without_backend": unserved,
        }
        await send_json(send, 503 if unserved else 200, orjson.dumps(body))
