"""The OpenAI-compatible routes: completions, chat, embeddings and the tenant's model list."""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson
from starlette.datastructures import Headers
from starlette.types import Receive, Scope, Send

from proxy.context import Operation, RequestContext
from proxy.errors import GatewayError
from proxy.upstream.meter import StreamMeter
from proxy.web.requestid import REQUEST_ID_KEY
from proxy.web.respond import send_error, send_json

if TYPE_CHECKING:
    from proxy.app import Gateway

__all__ = ["ModelList", "OpenAIEndpoint"]


class OpenAIEndpoint:
    """`POST /v1/chat/completions`, `/v1/completions`, `/v1/embeddings`: a pipeline run each."""

    def __init__(self, operation: Operation) -> None:
        self._operation: Operation = operation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gateway: Gateway = scope["state"]["gateway"]
        now = gateway.clock.monotonic()
        ctx = RequestContext(
            request_id=scope.get(REQUEST_ID_KEY, ""),
            operation=self._operation,
            received_s=now,
            received_wall=gateway.clock.wall(),
            meter=StreamMeter(now),
            headers=Headers(scope=scope),
        )
        await gateway.pipeline.run(ctx, receive, send)


class ModelList:
    """`GET /v1/models`: only the models the caller's tenant may use."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gateway: Gateway = scope["state"]["gateway"]
        try:
            tenant_name = gateway.keyring.tenant_for(Headers(scope=scope).get("authorization"))
        except GatewayError as exc:
            await send_error(send, exc)
            return
        tenant = gateway.policy.tenants[tenant_name]
        created = int(gateway.started_wall)
        body = {
            "object": "list",
            "data": [
                {"id": model, "object": "model", "created": created, "owned_by": "tokenweir"}
                for model in tenant.models
            ],
        }
        await send_json(send, 200, orjson.dumps(body))
