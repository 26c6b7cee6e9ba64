"""Which backend serves the request: the model's backends take turns, by weight.

Writes backend. Health-aware balancing and failover replace the plain rotation later.
"""

from __future__ import annotations

import itertools

from proxy.context import RequestContext
from proxy.policy.model import Backend, Policy

__all__ = ["Route"]


class Route:
    def __init__(self, policy: Policy) -> None:
        self._pools: dict[str, tuple[Backend, ...]] = {}
        self._turns: dict[str, itertools.count[int]] = {}
        for model in policy.models:
            pool = tuple(b for b in policy.backends_for(model) for _ in range(b.weight))
            self._pools[model] = pool
            self._turns[model] = itertools.count()

    async def __call__(self, ctx: RequestContext) -> None:
        pool = self._pools[ctx.model]  # parse has checked that the model exists
        ctx.backend = pool[next(self._turns[ctx.model]) % len(pool)]
