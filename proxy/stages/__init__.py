"""The request path, one small stage per job. Auth (an `Authenticator`) turns the arrival into
an `Admitted` context; each stage after it reads and writes that.

A stage says itself what else it is: `Traced` (it gets a child span of the request's when it
used storage), a settler (proxy/stages/account.py `Settler`: it holds something until the
request ends), a planner (proxy/stages/prefetch.py `Planner`: its storage steps go in the one
admission round trip). The gateway derives the traced stages, the settlers and the planners from
the stage list, so a new stage is its file and one line in proxy/gateway.py.
"""

from typing import ClassVar, Protocol, runtime_checkable

from proxy.context import Admitted, RequestContext

__all__ = ["Authenticator", "Stage", "Traced"]


class Authenticator(Protocol):
    async def __call__(self, ctx: RequestContext) -> Admitted:
        """The request, its caller known; or AuthenticationFailed."""


class Stage(Protocol):
    async def __call__(self, ctx: Admitted) -> None:
        """Do this stage's one job on `ctx`, or raise a GatewayError to reject the request."""


@runtime_checkable
class Traced(Protocol):
    """A stage timed for the request's trace: a child span named `span_name` is drawn when
    `touched` says it used storage for the request (checked as it ends)."""

    span_name: ClassVar[str]
    # True when what the stage takes is given back in the settle call: the settle span is
    # drawn for a request when such a stage touched storage.
    given_back_at_settle: ClassVar[bool]

    async def __call__(self, ctx: Admitted) -> None: ...

    def touched(self, ctx: Admitted) -> bool: ...
