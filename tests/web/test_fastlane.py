"""The inference routes' fast lane: a POST to one of their exact paths reaches its endpoint
directly, with the request id, the current gateway and the outermost error handler the
middleware would have given it; anything else goes through the middleware and the router."""

from __future__ import annotations

import asyncio
from typing import ClassVar

import pytest
import tiktoken
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.reload import CurrentGateway
from proxy.web.fastlane import LanedStarlette
from proxy.web.requestid import REQUEST_ID_KEY, RequestId

pytestmark = pytest.mark.anyio


class Answers:
    """An ASGI endpoint that records the scopes it was called with."""

    def __init__(self) -> None:
        self.scopes: list[Scope] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scopes.append(scope)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


class Passes:
    """Middleware that records the paths that went through it."""

    seen: ClassVar[list[str]] = []

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            Passes.seen.append(scope["path"])
        await self._app(scope, receive, send)


async def _handled(request: Request, exc: Exception) -> Response:
    return JSONResponse({"error": {"code": "internal_error"}}, status_code=500)


def app_of(lanes: dict[str, ASGIApp], behind: Answers) -> LanedStarlette:
    return LanedStarlette(
        lanes=lanes,
        routes=[
            *(Route(path, endpoint, methods=["POST"]) for path, endpoint in lanes.items()),
            Route("/v1/models", behind, methods=["GET", "POST"]),
        ],
        middleware=[Middleware(CurrentGateway), Middleware(RequestId), Middleware(Passes)],
        exception_handlers={Exception: _handled},
    )


class Live:
    current = "the gateway now"


def http(method: str, path: str, headers: list[tuple[bytes, bytes]] | None = None) -> Scope:
    return {
        "type": "http", "method": method, "path": path, "raw_path": path.encode(),
        "root_path": "", "query_string": b"", "headers": headers or [],
        "state": {"live": Live()},
    }  # fmt: skip


async def call(app: ASGIApp, scope: Scope, sent: list[Message]) -> list[Message]:
    """Call `app` with an empty body; what it sends goes to `sent` (kept if it raises)."""

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


def header(messages: list[Message], name: bytes) -> bytes | None:
    start = next(m for m in messages if m["type"] == "http.response.start")
    return next((value for key, value in start["headers"] if key == name), None)


async def test_a_post_to_an_inference_path_goes_straight_to_its_endpoint() -> None:
    chat, other, behind = Answers(), Answers(), Answers()
    Passes.seen = []
    app = app_of({"/v1/chat/completions": chat, "/v1/messages": other}, behind)
    scope = http("POST", "/v1/chat/completions", [(b"x-request-id", b"client-7")])
    sent = await call(app, scope, [])
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert header(sent, b"x-request-id") == b"client-7"
    assert chat.scopes == [scope]
    assert scope[REQUEST_ID_KEY] == "client-7"
    assert scope["state"]["gateway"] == "the gateway now"
    assert other.scopes == behind.scopes == Passes.seen == []  # past the middleware too


@pytest.mark.parametrize(
    ("scope", "status"),
    [
        (http("GET", "/v1/chat/completions"), 405),  # the router answers, as before
        (http("POST", "/v1/chat/completions/"), 307),  # not exactly its path: the router redirects
        (http("POST", "/v1/models"), 200),  # a route that is not a lane
    ],
)
async def test_anything_else_goes_through_the_middleware_and_the_router(
    scope: Scope, status: int
) -> None:
    chat, behind = Answers(), Answers()
    Passes.seen = []
    sent = await call(app_of({"/v1/chat/completions": chat}, behind), scope, [])
    assert sent[0]["status"] == status
    assert header(sent, b"x-request-id") is not None
    assert Passes.seen == [scope["path"]]
    assert chat.scopes == []


async def test_an_error_nothing_caught_gets_the_apps_500_then_is_raised_again() -> None:
    async def broken(scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("a bug")

    app = app_of({"/v1/chat/completions": broken}, Answers())
    sent: list[Message] = []
    with pytest.raises(RuntimeError, match="a bug"):  # for the server to log
        await call(app, http("POST", "/v1/chat/completions"), sent)
    assert sent[0]["status"] == 500
    assert b"internal_error" in sent[1]["body"]
    assert (
        header(
            sent,
            b"x-request-id",
        )
        is not None
    )


async def test_an_error_after_the_answer_began_sends_nothing_more() -> None:
    async def breaks_midway(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("midway")

    app = app_of({"/v1/chat/completions": breaks_midway}, Answers())
    sent: list[Message] = []
    with pytest.raises(RuntimeError, match="midway"):
        await call(app, http("POST", "/v1/chat/completions"), sent)
    assert [m["type"] for m in sent] == ["http.response.start"]


async def test_a_panic_in_a_rust_extension_gets_the_apps_500_too() -> None:
    """pyo3's PanicException is a BaseException: Starlette's handler for Exception missed it, and
    the server answered a bare text `Internal Server Error`."""

    async def panics(scope: Scope, receive: Receive, send: Send) -> None:
        blanks = tiktoken.Encoding(
            "blanks",
            pat_str=r"\s+(?!\S)|\s+|\S+",
            mergeable_ranks={bytes([i]): i for i in range(256)},
            special_tokens={},
        )
        blanks.encode_ordinary(" " * 1_100_000)  # the regex engine's stack overflows

    app = app_of({"/v1/chat/completions": panics}, Answers())
    sent: list[Message] = []
    with pytest.raises(BaseException, match="StackOverflow") as raised:
        await call(app, http("POST", "/v1/chat/completions"), sent)
    assert not isinstance(raised.value, Exception)
    assert sent[0]["status"] == 500
    assert b"internal_error" in sent[1]["body"]


async def test_a_cancelled_request_gets_no_answer() -> None:
    async def cancelled(scope: Scope, receive: Receive, send: Send) -> None:
        raise asyncio.CancelledError

    app = app_of({"/v1/chat/completions": cancelled}, Answers())
    sent: list[Message] = []
    with pytest.raises(asyncio.CancelledError):
        await call(app, http("POST", "/v1/chat/completions"), sent)
    assert sent == []
