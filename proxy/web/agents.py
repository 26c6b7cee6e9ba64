"""The Anthropic-compatible routes: `POST /v1/messages` (a pipeline run, Anthropic's key header
and error shape) and `POST /v1/messages/count_tokens` (answered by the gateway's tokenizer)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from starlette.types import Receive, Scope, Send

from proxy.apis import AGENT_APIS
from proxy.apis import messages as messages_api
from proxy.apis.anthropic import AnthropicErrors, with_api_key
from proxy.asgi.body import ClientGone, read_body
from proxy.asgi.headers import RequestHeaders
from proxy.asgi.respond import send_error, send_json
from proxy.context import Admitted, RequestContext
from proxy.errors import BadRequest, GatewayError
from proxy.keys.record import KeyRecord
from proxy.stages.auth import authorization_of
from proxy.stages.degrade import spilled_to
from proxy.stages.parse import Parse, check_fields
from proxy.tokens import TokenizerError
from proxy.tokens.segments import counting_for, done_counting
from proxy.upstream.meter import StreamMeter
from proxy.web.openai import OpenAIEndpoint
from proxy.web.requestid import REQUEST_ID_KEY

if TYPE_CHECKING:
    from proxy.gateway import Gateway

__all__ = ["CountTokens", "MessagesEndpoint"]

_COUNT_CHECKS = {"messages": messages_api.MESSAGES, **messages_api.COUNT_CHECKS}


class MessagesEndpoint:
    """`POST /v1/messages`: the chat pipeline's stages on Anthropic's request and answer."""

    def __init__(self) -> None:
        self._endpoint = OpenAIEndpoint("messages")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        errors = AnthropicErrors(send, scope.get(REQUEST_ID_KEY, ""))
        await self._endpoint(with_api_key(scope), receive, errors)


class CountTokens:
    """`POST /v1/messages/count_tokens`: `{"input_tokens": N}`, N counted with the model's
    tokenizer over what the gateway would send (the tenant's system prompt included). Nothing is
    billed and no backend is called; it takes one request from the tenant's
    requests_per_minute and the key's own, and answers with their x-ratelimit-* headers."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gateway: Gateway = scope["state"]["gateway"]
        send = AnthropicErrors(send, scope.get(REQUEST_ID_KEY, ""))
        scope = with_api_key(scope)
        now = gateway.clock.monotonic()
        ctx = RequestContext(
            request_id=scope.get(REQUEST_ID_KEY, ""),
            operation="messages",
            received_s=now,
            received_wall=gateway.clock.wall(),
            meter=StreamMeter(now),
            headers=RequestHeaders(scope=scope),
        )
        try:
            ctx = await self._answer(gateway, ctx, receive, send)
        finally:  # an access line, and a refusal counted; nothing is billed
            if not ctx.status:  # an unexpected error: the outermost handler answers a 500
                ctx.outcome.status, ctx.outcome.error_code = 500, "internal_error"
            gateway.pipeline.account.unbilled(ctx, "count_tokens")

    async def _answer(
        self, gateway: Gateway, arrival: RequestContext, receive: Receive, send: Send
    ) -> RequestContext:
        """Answer the request; what it came to is in the context returned (its caller known)."""
        ctx = arrival
        shown: list[tuple[bytes, bytes]] = []  # the gateway's headers, once the caller is known
        try:
            name, key_id, record = gateway.keyring.identify_key(authorization_of(ctx.headers))
            ctx = admitted = arrival.admit(name, gateway.policy.tenants[name], key_id)
            count, rule = await self._count(gateway, admitted, record, receive, shown)
        except GatewayError as exc:
            ctx.outcome.refused(exc.status, exc.code or exc.type)
            await send_error(send, exc, shown)
            return ctx
        except ClientGone:
            ctx.outcome.status, ctx.outcome.error_code = 499, "client_closed"
            ctx.outcome.client_disconnected = True
            return ctx
        if rule is not None:  # the rule's model counted: the client's own count may differ
            shown.append((b"x-tokenweir-degraded", rule.encode()))
        ctx.outcome.status, ctx.counted_input_tokens = 200, count
        await send_json(send, 200, orjson.dumps({"input_tokens": count}), shown)
        return ctx

    async def _count(
        self,
        gateway: Gateway,
        ctx: Admitted,
        record: KeyRecord | None,
        receive: Receive,
        shown: list[tuple[bytes, bytes]],
    ) -> tuple[int, str | None]:
        policy = gateway.policy
        try:
            await gateway.services.rate_limits.admit_count(ctx, record)
        finally:
            shown += ctx.gateway_headers()
        server = policy.server
        ctx.raw_body = await read_body(
            receive, ctx.headers, server.max_body_bytes, server.body_timeout
        )
        body: dict[str, Any] = Parse(policy.models).read(ctx)
        check_fields(body, ("messages",), _COUNT_CHECKS)
        system_prompt = ctx.tenant.budget.system_prompt
        if system_prompt is not None:
            AGENT_APIS["messages"].add_system(body, system_prompt)
        chat, tools = messages_api.to_chat(body)
        model, rule = await _counted_model(gateway, ctx)
        counting = counting_for(ctx.tenant_name)
        try:
            return await gateway.counters.count_chat(model, chat, tools), rule
        except TokenizerError as exc:
            raise BadRequest(
                f"The messages do not fit the model's chat format: {exc}", param="messages"
            ) from exc
        finally:
            done_counting(counting)


async def _counted_model(gateway: Gateway, ctx: Admitted) -> tuple[str, str | None]:
    """The model whose tokenizer counts the messages, as it would count the request itself:
    the one a live degradation rule would send it to (and the rule's name), else the one asked."""
    if not ctx.tenant.degrade:
        return ctx.model, None
    live, _ = await gateway.degrade.choose(ctx)
    spill = spilled_to(live, ctx.operation)
    if live is None or spill is None or spill == ctx.model:
        return ctx.model, None
    return spill, live.name
