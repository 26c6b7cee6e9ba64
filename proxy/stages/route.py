"""Which backend serves the request: model known, tenant allowed, backends in weighted rotation.

Writes backend. Health-aware balancing and failover replace the plain rotation later.
"""

from __future__ import annotations

import itertools

from proxy.context import RequestContext
from proxy.errors import ModelNotFound, PermissionDenied
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
        tenant = ctx.tenant
        if tenant is None:
            raise RuntimeError("auth must run before route")
        pool = self._pools.get(ctx.model)
        if pool is None:
            raise ModelNotFound(
                f"The model `{ctx.model}` does not exist or you do not have access to it.",
                param="model",
            )
        if ctx.model not in tenant.models:
            raise PermissionDenied(
                f"Your API key may not use the model `{ctx.model}`.", param="model"
            )
        ctx.backend = pool[next(self._turns[ctx.model]) % len(pool)]
