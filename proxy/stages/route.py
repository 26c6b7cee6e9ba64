"""Which backend serves the request: the stage holds the first of the model's pool (or a
fallback model's) that is available and admits the request on its own limits; Forward's upstream
call then fails over through the same `Attempts` (proxy/routing/attempts.py).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import ClassVar

from proxy.context import Admitted
from proxy.routing.attempts import Attempts

__all__ = ["Route"]


class Route:
    span_name: ClassVar[str] = "tokenweir.backend_limit.admit"
    given_back_at_settle: ClassVar[bool] = True

    def __init__(self, attempts: Attempts) -> None:
        self._attempts = attempts

    async def __call__(self, ctx: Admitted) -> None:
        await self._attempts.begin(ctx)  # Forward opens the call through it

    def touched(self, ctx: Admitted) -> bool:
        """The chosen backend has limits: the request was admitted against them in storage."""
        limits = ctx.backend.limits if ctx.backend else None
        return limits is not None and bool(
            limits.requests_per_minute or limits.tokens_per_minute or limits.max_concurrent
        )

    def holding(self, ctx: Admitted) -> bool:
        return self._attempts.holding(ctx)

    def settle(self, ctx: Admitted) -> Awaitable[None]:
        return self._attempts.settle(ctx)
