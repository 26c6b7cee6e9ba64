"""The request path, one small stage per job; each reads and writes the RequestContext."""

from typing import Protocol

from proxy.context import RequestContext

__all__ = ["Stage"]


class Stage(Protocol):
    async def __call__(self, ctx: RequestContext) -> None:
        """Do this stage's one job on `ctx`, or raise a GatewayError to reject the request."""
