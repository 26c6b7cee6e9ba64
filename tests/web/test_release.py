"""A client that asks again the instant an answer ends finds that request settled: its
concurrency slot free and its answer in the cache.

These tests drive the real app (lifespan, stages, real mock backend over HTTP) through ASGI
directly, so "the instant" is exact: the next request runs inside the `send` that hands the
server the previous answer's last byte.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from starlette.types import ASGIApp, Message

from proxy.app import create_app
from proxy.policy import parse_policy
from tests.web.test_ratelimits import KEY, limits_policy_text

pytestmark = pytest.mark.anyio


class Answer:
    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""


async def ask(
    app: ASGIApp, state: dict[str, Any], body: dict[str, Any], then: Any = None
) -> Answer:
    """One request; `then()` runs inside the send that ends the answer for a client: the one
    with a stream's [DONE], else the last one."""
    answer = Answer()
    raw = orjson.dumps(body)
    never = asyncio.Event()
    sent = False
    pending = [then] if then is not None else []

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await never.wait()  # the client stays connected
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            answer.status = message["status"]
            answer.headers = {k.decode(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            answer.body += message.get("body", b"")
            # A client acts on a stream's [DONE] (the SDK stops reading there), else on the end.
            ended = b"data: [DONE]" in answer.body or not message.get("more_body", False)
            if ended and pending:
                await pending.pop()()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"authorization", f"Bearer {KEY}".encode()),
            (b"content-type", b"application/json"),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
        "state": dict(state),
    }
    await app(scope, receive, send)
    return answer


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("storage", ["memory", "redis"])
async def test_the_next_request_finds_the_last_one_settled(
    backend_url: str, redis_url: str, storage: str, stream: bool
) -> None:
    storage_url = redis_url if storage == "redis" else "memory"
    text = limits_policy_text(backend_url, "{max_concurrent: 1}", storage_url, "{mode: exact}")
    app = create_app(parse_policy(text, environ={}))
    question = {
        "model": "mock-llm",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0,
        "max_tokens": 100,
        "stream": stream,
    }
    other = {**question, "messages": [{"role": "user", "content": "And of Spain?"}]}
    follow_ups: list[Answer] = []

    async def ask_again() -> None:
        follow_ups.append(await ask(app, state, question))  # the same question: a hit
        follow_ups.append(await ask(app, state, other))  # a new one: needs the slot

    async with app.router.lifespan_context(app) as state:
        first = await ask(app, state, question, then=ask_again)
    assert [first.status, *(a.status for a in follow_ups)] == [200, 200, 200]
    assert [first.headers["x-tokenweir-cache"], follow_ups[0].headers["x-tokenweir-cache"]] == [
        "miss",
        "hit",
    ]
    assert follow_ups[1].headers["x-tokenweir-cache"] == "miss"
