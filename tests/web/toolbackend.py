"""A chat backend on 127.0.0.1 that answers with tool calls and checks them as OpenAI does.

Every answer is `CALLS` parallel tool calls (stream: the id and name first, the arguments in
pieces, as vLLM and OpenAI send them; `n` choices each), `finish_reason: tool_calls`, usage.
Like OpenAI, it answers 400 to a conversation with a `tool` message that follows no assistant
`tool_calls` naming its id, or an assistant `tool_calls` whose ids are not all answered.
`received` keeps every request body it was sent. `gemini` set, a stream sends each call whole in
one delta without its `index`, with a `thought_signature` to send back, as Google's
OpenAI-compatible endpoint does.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

from tests.servers import serve
from tests.web.lyingbackend import read_body, send_whole

CALLS = (
    ("call_a1", "get_weather", '{"city": "Paris", "unit": "celsius"}'),
    ("call_b2", "get_time", '{"zone": "Europe/Paris"}'),
)
USAGE = {"prompt_tokens": 31, "completion_tokens": 17, "total_tokens": 48}


class ToolBackend:
    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.gemini = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        if scope["path"] == "/v1/models":
            await send_whole(send, 200, b'{"object": "list", "data": []}', b"application/json")
            return
        request = orjson.loads(body)
        self.received.append(request)
        problem = tool_order_problem(request.get("messages") or [])
        n = request.get("n") or 1
        if problem is not None:
            error = {"error": {"message": problem, "type": "invalid_request_error"}}
            await send_whole(send, 400, orjson.dumps(error), b"application/json")
        elif request.get("stream"):
            await send_whole(send, 200, b"".join(_events(n, self.gemini)), b"text/event-stream")
        else:
            await send_whole(send, 200, _whole(n), b"application/json")


def tool_order_problem(messages: Sequence[Mapping[str, Any]]) -> str | None:
    """OpenAI's rule, in its words: None when every tool result answers the call before it."""
    waiting: set[str] = set()
    for message in messages:
        role = message.get("role")
        if role == "tool":
            if message.get("tool_call_id") not in waiting:
                return (
                    "messages with role 'tool' must be a response to a preceeding message "
                    "with 'tool_calls'."
                )
            waiting.discard(message["tool_call_id"])
            continue
        if waiting:
            return "An assistant message with 'tool_calls' must be followed by tool messages."
        if role == "assistant":
            waiting = {call["id"] for call in message.get("tool_calls") or []}
    return None


def _calls(streamed: bool) -> list[dict[str, Any]]:
    return [
        {"index": i, "id": id_, "type": "function", "function": {"name": name, "arguments": args}}
        if streamed
        else {"id": id_, "type": "function", "function": {"name": name, "arguments": args}}
        for i, (id_, name, args) in enumerate(CALLS)
    ]


def _whole(n: int) -> bytes:
    message = {"role": "assistant", "content": None, "tool_calls": _calls(False)}
    choices = [{"index": i, "message": message, "finish_reason": "tool_calls"} for i in range(n)]
    return orjson.dumps(
        {"id": "t1", "object": "chat.completion", "model": "m", "choices": choices, "usage": USAGE}
    )


def _events(n: int, gemini: bool) -> Iterator[bytes]:
    def event(choice: int, delta: dict[str, Any], finish: str | None = None) -> bytes:
        item = {"index": choice, "delta": delta, "finish_reason": finish}
        chunk = {"id": "t1", "object": "chat.completion.chunk", "model": "m", "choices": [item]}
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    for choice in range(n):
        yield event(choice, {"role": "assistant", "content": None})
        for i, (id_, name, args) in enumerate(CALLS):
            if gemini:
                call = {
                    "id": id_,
                    "type": "function",
                    "function": {"name": name, "arguments": args},
                }
                signed = {**call, "extra_content": {"google": {"thought_signature": f"sig{i}"}}}
                yield event(choice, {"tool_calls": [signed]})
                continue
            head = {"index": i, "id": id_, "type": "function", "function": {"name": name}}
            yield event(choice, {"tool_calls": [head]})
            for start in range(0, len(args), 5):  # the arguments in pieces
                piece = {"index": i, "function": {"arguments": args[start : start + 5]}}
                yield event(choice, {"tool_calls": [piece]})
        yield event(choice, {}, "tool_calls")
    yield b'data: {"id": "t1", "choices": [], "usage": ' + orjson.dumps(USAGE) + b"}\n\n"
    yield b"data: [DONE]\n\n"


@contextmanager
def tool_backend() -> Iterator[tuple[ToolBackend, str]]:
    """The backend and its URL."""
    app = ToolBackend()
    with serve(app) as url:
        yield app, url
