"""The gateway's Starlette app, with a fast lane: a POST to an inference route's exact path goes
straight to its endpoint, past Starlette's middleware stack and router.

While a stream is relayed, every await resumes each coroutine frame between the server and the
stream's read, and every `send` goes back out through each middleware's wrapper. An inference
endpoint needs none of Starlette's: it answers its own errors. So the lane does, in its one
frame and one wrapper, what the middleware would do for it: the gateway current at the start
(`take_current`), the request id and its `x-request-id` header (`IdSender`), and, as Starlette's
outermost handler, an answer from the app's handler for `Exception` to an error nothing caught
(a Rust extension's panic too) while nothing was sent yet, the error then raised again for the
server to log. Any other method or path (a 405, a 404, the dashboard, a path under a
`root_path`, the lifespan) goes the usual way, so its answer is as before; a lifespan that
fails with CannotStart is said in one line (proxy/web/startup.py).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Mapping
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.asgi.direct import lent_cycle
from proxy.reload import take_current
from proxy.web.requestid import IdSender, assign_request_id
from proxy.web.startup import said_plainly

__all__ = ["LanedStarlette"]


class LanedStarlette(Starlette):
    def __init__(self, *, lanes: Mapping[str, ASGIApp], **starlette: Any) -> None:
        """`lanes`: the endpoint of each inference route's path; the rest is Starlette's."""
        super().__init__(**starlette)
        self._lanes = dict(lanes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self._lanes.get(scope["path"])
            if endpoint is not None:
                scope["app"] = self
                await self._lane(endpoint, scope, receive, send)
                return
        elif scope["type"] == "lifespan":
            await said_plainly(super().__call__, scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    async def _lane(self, endpoint: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        take_current(scope)
        sender = IdSender(send, assign_request_id(scope), lent_cycle(scope))
        try:
            await endpoint(scope, receive, sender)
        except BaseException as exc:
            if not sender.started and _is_failure(exc):
                response = await self._unexpected(Request(scope), exc)
                await response(scope, receive, sender)
            raise

    async def _unexpected(self, request: Request, exc: BaseException) -> Response:
        """The answer Starlette's ServerErrorMiddleware would give (not in debug mode)."""
        handler = self.exception_handlers.get(Exception) or self.exception_handlers.get(500)
        if handler is None:
            return PlainTextResponse("Internal Server Error", status_code=500)
        response = handler(request, exc)
        if inspect.isawaitable(response):
            response = await response
        return response  # type: ignore[no-any-return]


def _is_failure(exc: BaseException) -> bool:
    """An error to answer 500 for: any Exception, and a panic in a Rust extension (pyo3's
    PanicException derives from BaseException: a tokenizer's panic was a bare text 500), but not
    the task's cancellation or the process's exit."""
    return isinstance(exc, Exception) or not isinstance(
        exc, asyncio.CancelledError | KeyboardInterrupt | SystemExit | GeneratorExit
    )
