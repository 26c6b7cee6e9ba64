"""A backend whose every answer a test writes itself: the SSE events and the pauses between them,
or an error status with an OpenAI error body, for judging the gateway's figures against it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

__all__ = [
    "AtLeast",
    "Received",
    "Script",
    "chunk",
    "event",
    "named",
    "scripted_backend",
    "usage_chunk",
]


class Received:
    """Lock-step with the client: the client counts each event it reads (`add`), and a stream's
    step `received.at(n)` waits until it has read n, so the next event reaches the gateway in a
    read of its own whatever the machine's load (a pause only makes that likely)."""

    def __init__(self) -> None:
        self._count = 0
        self._changed = threading.Condition()

    def add(self) -> None:
        with self._changed:
            self._count += 1
            self._changed.notify_all()

    def at(self, count: int) -> AtLeast:
        return AtLeast(self, count)

    def _wait(self, count: int) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: self._count >= count, timeout=30):
                raise TimeoutError(f"the client read {self._count} events, not {count}")


class AtLeast:
    def __init__(self, received: Received, count: int) -> None:
        self.received, self.count = received, count


Script = Sequence[bytes | float | AtLeast] | tuple[int, dict[str, Any]]
"""Events (bytes), pauses (seconds) and waits for the client (Received.at) of a stream, or
(status, error fields) of a refusal."""


def chunk(delta: dict[str, Any], finish_reason: str | None = None, index: int = 0) -> bytes:
    """One chat completion chunk event for choice `index`."""
    event = {
        "id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": 1,
        "model": "mock-llm",
        "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason}],
    }  # fmt: skip
    return b"data: " + orjson.dumps(event) + b"\n\n"


def event(payload: dict[str, Any]) -> bytes:
    """Any data event, as written."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def named(payload: dict[str, Any]) -> bytes:
    """An event of the agent APIs (Messages, Responses): named by its `type`."""
    return b"event: " + str(payload["type"]).encode() + b"\n" + event(payload)


def usage_chunk(prompt_tokens: int, completion_tokens: int) -> bytes:
    event = {
        "id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": 1,
        "model": "mock-llm", "choices": [],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }  # fmt: skip
    return b"data: " + orjson.dumps(event) + b"\n\n"


def scripted_backend(scripts: dict[str, Script]) -> Starlette:
    """A backend answering each chat or Messages request by the script named by its first
    message's text, and each Responses request by the one its `input` names."""

    async def chat(request: Request) -> Response:
        body = await request.json()
        script = scripts[body["input"] if "input" in body else body["messages"][0]["content"]]
        if isinstance(script, tuple):
            status, error = script
            return JSONResponse({"error": error}, status_code=status)
        return StreamingResponse(_played(script), media_type="text/event-stream")

    async def models(request: Request) -> Response:  # the gateway's health probe
        return JSONResponse({"object": "list", "data": [{"id": "mock-llm", "object": "model"}]})

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/messages", chat, methods=["POST"]),
            Route("/v1/responses", chat, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
        ]
    )


async def _played(script: Sequence[bytes | float | AtLeast]) -> AsyncIterator[bytes]:
    for step in script:
        if isinstance(step, bytes):
            yield step
        elif isinstance(step, AtLeast):
            await asyncio.to_thread(step.received._wait, step.count)
        else:
            await asyncio.sleep(step)
