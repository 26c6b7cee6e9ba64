"""The OpenAI-compatible routes: completions, chat, embeddings, responses and the tenant's model
list."""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson
from starlette.datastructures import Headers, QueryParams
from starlette.types import Receive, Scope, Send

from proxy.apis.anthropic import AnthropicErrors, anthropic_models, with_api_key
from proxy.asgi.direct import lent_cycle
from proxy.asgi.headers import RequestHeaders
from proxy.asgi.respond import send_error, send_json
from proxy.context import Operation, RequestContext
from proxy.errors import GatewayError, ModelNotFound
from proxy.stages.auth import authorization_of
from proxy.upstream.meter import StreamMeter
from proxy.web.requestid import REQUEST_ID_KEY

if TYPE_CHECKING:
    from proxy.gateway import Gateway

__all__ = ["ModelList", "OpenAIEndpoint"]


class OpenAIEndpoint:
    """`POST /v1/chat/completions`, `/v1/completions`, `/v1/embeddings`, `/v1/responses` (and,
    behind MessagesEndpoint, `/v1/messages`): a pipeline run each."""

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
            headers=RequestHeaders(scope=scope),
            server_cycle=lent_cycle(scope),
        )
        await gateway.pipeline.run(ctx, receive, send)


class ModelList:
    """`GET /v1/models`: only the models the caller's tenant may use; `GET /v1/models/{id}`: one
    of them, and 404 for any other (a model the tenant may not use is not shown to exist).

    The key may come as `x-api-key`. A request with `anthropic-version` (Anthropic's SDKs send
    it) is answered in Anthropic's shape, its list paged by `limit`, `after_id` and `before_id`
    (apis/anthropic.py)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gateway: Gateway = scope["state"]["gateway"]
        headers = Headers(scope=with_api_key(scope))  # the key as Anthropic's SDKs send it too
        anthropic = "anthropic-version" in headers
        if anthropic:
            send = AnthropicErrors(send, scope.get(REQUEST_ID_KEY, ""))
        wanted: str | None = scope.get("path_params", {}).get("model_id")
        try:
            tenant_name = gateway.keyring.tenant_for(authorization_of(headers))
            models = gateway.policy.tenants[tenant_name].models
            if wanted is not None and wanted not in models:
                raise ModelNotFound.named(wanted)
            created = int(gateway.started_wall)
            if anthropic:
                query = QueryParams(scope.get("query_string", b""))
                body = anthropic_models(models, wanted, created, query)
            elif wanted is None:
                body = {"object": "list", "data": [_model(model, created) for model in models]}
            else:
                body = _model(wanted, created)
        except GatewayError as exc:
            await send_error(send, exc)
            return
        await send_json(send, 200, orjson.dumps(body))


def _model(name: str, created: int) -> dict[str, object]:
    return {"id": name, "object": "model", "created": created, "owned_by": "tokenweir"}
