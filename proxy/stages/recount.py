"""A fallback model's count: the input shaped again with the tokenizer of the fallback model
a request is routed to, when it is not the asked model's, before the request is sent there.
Writes counted_input_tokens (and the body's messages, if they are trimmed to fit).
"""

from __future__ import annotations

from proxy.context import Admitted
from proxy.errors import ContextLengthExceeded
from proxy.stages.shape import Shape
from proxy.tokens import TokenCounters

__all__ = ["Recount"]


class Recount:
    """`max_input_tokens` (its refusal or trim), the served model's limits and the bill of a
    backend that reports no usage take the count of the model that serves the request: the
    asked model's tokenizer may read the same prompt as far fewer tokens."""

    def __init__(self, shape: Shape, counters: TokenCounters) -> None:
        self._shape = shape
        self._counters = counters

    async def __call__(self, ctx: Admitted, counted_for: str) -> None:
        """The request was counted for `counted_for` and now goes to `ctx.model`."""
        if ctx.counted_input_tokens is None:
            return  # nothing needed the count: the account counts what the backend answered
        counters = self._counters
        if counters.for_model(counted_for) is counters.for_model(ctx.model):
            return  # one tokenizer: the same count
        try:
            await self._shape.shape_input(ctx, ctx.tenant, ctx.model)
        except ContextLengthExceeded as exc:
            raise ContextLengthExceeded(
                f"{exc.message} It was counted with the tokenizer of {ctx.model!r}, the "
                f"fallback model serving it while no backend of {counted_for!r} is available.",
                param=exc.param,
            ) from None
