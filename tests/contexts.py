"""Requests as auth hands them to the stages, built by hand for tests of one stage."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.apis import output_fields
from proxy.context import Admitted, Operation, RequestContext
from proxy.outgoing import OutgoingRequest
from proxy.policy.model import Tenant
from proxy.policy.units import hash_key
from proxy.upstream.meter import StreamMeter

ANYONE = Tenant(api_keys=(hash_key("k"),), models=("m",))


def arrival(
    operation: Operation = "chat", *, headers: Mapping[str, str] = {}, received_wall: float = 0.0
) -> RequestContext:
    return RequestContext("r", operation, 0.0, received_wall, StreamMeter(0.0), headers=headers)


def admitted(
    tenant: Tenant = ANYONE,
    body: dict[str, Any] | None = None,
    *,
    operation: Operation = "chat",
    tenant_name: str = "t",
    headers: Mapping[str, str] = {},
    received_wall: float = 0.0,
    counted: int | None = None,
    allowance: int | None = None,
) -> Admitted:
    """A request admitted for `tenant`; its outgoing request is `body` as parse reads it (its
    model the body's, else "m"), with `counted` input tokens and an output `allowance`."""
    ctx = arrival(operation, headers=headers, received_wall=received_wall)
    ctx = ctx.admit(tenant_name, tenant, None)
    body = {"model": "m"} if body is None else body
    ctx.outgoing = OutgoingRequest(body, body.get("model", "m"), output_fields(operation))
    ctx.outgoing.allowance = allowance
    ctx.counted_input_tokens = counted
    return ctx
