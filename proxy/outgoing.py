"""What the gateway changes in the request it sends upstream, each in one place: the model
(`set_model`) and the bound on the answer's length (`bound_output`, which keeps the body's
output fields and `ctx.output_allowance` in step and records why in `ctx.shaped`)."""

from __future__ import annotations

from proxy.apis import output_fields
from proxy.context import RequestContext

__all__ = ["bound_output", "output_allowance", "set_model"]


def set_model(ctx: RequestContext, name: str) -> None:
    """Send the request to `name` instead (a degradation rule, a fallback model)."""
    ctx.model = ctx.body["model"] = name


def bound_output(ctx: RequestContext, limit: int, reason: str | None) -> None:
    """Bound the answer to `limit` tokens: each output field the body sets is lowered to it
    (never raised), and with none set the operation's own field is set to it. `reason`, a
    shaping name, is recorded once when the body changed."""
    body, fields = ctx.body, output_fields(ctx.operation)
    present = [field for field in fields if body.get(field) is not None]
    changed = not present
    if not present:
        body[fields[-1]] = limit
    for field in present:
        if body[field] > limit:
            body[field] = limit
            changed = True
    bound = output_allowance(ctx)
    if ctx.output_allowance is not None and bound is not None:
        bound = min(bound, ctx.output_allowance)
    ctx.output_allowance = bound
    if changed and reason is not None and reason not in ctx.shaped:
        ctx.shaped.append(reason)


def output_allowance(ctx: RequestContext) -> int | None:
    """The most output tokens the body allows (None: it sets no bound)."""
    values = [ctx.body[f] for f in output_fields(ctx.operation) if ctx.body.get(f) is not None]
    return min(values) if values else None
