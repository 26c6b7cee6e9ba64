"""The inference routes' fast lane: a POST to one of their exact paths reaches its endpoint
directly; anything else reaches the app behind it, unchanged."""

from __future__ import annotations

import pytest
from starlette.types import Message, Receive, Scope, Send

from proxy.web.fastlane import FastLane

pytestmark = pytest.mark.anyio


class Answers:
    """An ASGI app that records the scopes it was called with."""

    def __init__(self) -> None:
        self.scopes: list[Scope] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scopes.append(scope)
        await send({"type": "http.response.start", "status": 200, "headers": []})


async def call(app: FastLane, scope: Scope) -> list[Message]:
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


def http(method: str, path: str) -> Scope:
    return {"type": "http", "method": method, "path": path, "headers": []}


async def test_a_post_to_an_inference_path_goes_straight_to_its_endpoint() -> None:
    chat, other, behind = Answers(), Answers(), Answers()
    lane = FastLane(behind, routes={"/v1/chat/completions": chat, "/v1/messages": other})
    scope = http("POST", "/v1/chat/completions")
    assert await call(lane, scope) == [
        {"type": "http.response.start", "status": 200, "headers": []}
    ]
    assert chat.scopes == [scope]
    assert other.scopes == behind.scopes == []


@pytest.mark.parametrize(
    "scope",
    [
        http("GET", "/v1/chat/completions"),  # the router answers 405, as before
        http("POST", "/v1/chat/completions/"),  # a path that is not exactly the route's
        http("POST", "/gw/v1/chat/completions"),  # under a root_path: the router strips it
        http("POST", "/v1/models"),
        {"type": "websocket", "path": "/v1/chat/completions", "headers": []},
        {"type": "lifespan"},
    ],
)
async def test_anything_else_goes_the_usual_way(scope: Scope) -> None:
    chat, behind = Answers(), Answers()
    lane = FastLane(behind, routes={"/v1/chat/completions": chat})
    await call(lane, scope)
    assert behind.scopes == [scope]
    assert chat.scopes == []
