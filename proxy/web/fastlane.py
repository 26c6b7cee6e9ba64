"""Pure ASGI middleware: a POST to an inference route goes straight to its endpoint, past
Starlette's exception middleware and router.

While a stream is relayed, every await resumes each coroutine frame between the server and the
stream's read, and every `send` goes back out through each middleware's wrapper. The router
and the exception middleware are six of those frames and one wrapper; an inference endpoint
needs none of them (it answers its own errors, and an unexpected one still reaches Starlette's
outermost handler). Any other method or path (a 405, a 404, the dashboard, a path under a
`root_path`) goes the usual way, so its answer is as before.
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["FastLane"]


class FastLane:
    def __init__(self, app: ASGIApp, routes: Mapping[str, ASGIApp]) -> None:
        self._app = app
        self._routes = dict(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self._routes.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await self._app(scope, receive, send)
