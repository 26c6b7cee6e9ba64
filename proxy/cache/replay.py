"""A stored answer sent back the way the backend would: a whole response, or SSE chunks.

Each hit gets a new id and created time. A stream replay is role chunk, text chunks of a few
words each, tool calls, finish chunk, usage chunk when asked, `[DONE]`, all in one write.
"""

from __future__ import annotations

from random import getrandbits
from typing import Any

import orjson

from proxy.cache.answer import Answer
from proxy.upstream.exactints import as_written

__all__ = ["replay_response", "replay_stream"]


def _fresh_id() -> str:
    """96 random bits in hex, from `random` as the request ids (proxy/web/requestid.py says why
    not os.urandom): an answer's id names it, it guards nothing."""
    return f"{getrandbits(96):024x}"


# Text is cut into pieces of about this many characters, on a space where there is one.
_PIECE_CHARS = 48
_OBJECTS = {
    "chat": ("chat.completion", "chat.completion.chunk", "chatcmpl-"),
    "text_completion": ("text_completion", "text_completion", "cmpl-"),
}


def replay_response(answer: Answer, created: int) -> bytes:
    whole, _, prefix = _OBJECTS[answer.operation]
    choice: dict[str, Any] = {"index": 0, "finish_reason": answer.finish_reason, "logprobs": None}
    if answer.operation == "chat":
        choice["message"] = answer.message
    else:
        choice["text"] = answer.text
    body = {**_head(answer, whole, prefix, created), "choices": [choice], "usage": answer.usage}
    return as_written(orjson.dumps(body), body, answer.stored)


def replay_stream(answer: Answer, created: int, *, include_usage: bool) -> bytes:
    _, chunk_object, prefix = _OBJECTS[answer.operation]
    head = _head(answer, chunk_object, prefix, created)
    chat = answer.operation == "chat"
    frames = [_frame(head, _choice(chat, {"role": "assistant", "content": ""}))] if chat else []
    for name, text in _texts(answer):
        for piece in _pieces(text):
            delta = {name: piece} if chat else piece
            frames.append(_frame(head, _choice(chat, delta)))
    # Only these frames may hold a backend's integer past 64 bits (a text piece never does).
    stored = answer.stored
    for index, call in enumerate((answer.message or {}).get("tool_calls") or []):
        call_delta = {"tool_calls": [{"index": index, **call}]}
        frames.append(_frame(head, _choice(chat, call_delta), stored))
    frames.append(_frame(head, _choice(chat, {} if chat else "", answer.finish_reason)))
    if include_usage:
        frames.append(_frame({**head, "choices": [], "usage": answer.usage}, None, stored))
    frames.append(b"data: [DONE]\n\n")
    return b"".join(frames)


def _head(answer: Answer, kind: str, prefix: str, created: int) -> dict[str, Any]:
    """The fields an answer, or each chunk of one, begins with: a new id and time."""
    return {
        "id": prefix + _fresh_id(),
        "object": kind,
        "created": created,
        "model": answer.model,
        "system_fingerprint": answer.system_fingerprint,
    }


def _texts(answer: Answer) -> list[tuple[str, str]]:
    if answer.operation != "chat":
        return [("text", answer.text or "")]
    message = answer.message or {}
    return [
        (name, message[name])
        for name in ("reasoning_content", "reasoning", "content", "refusal")
        if isinstance(message.get(name), str) and message[name]
    ]


def _choice(chat: bool, delta: Any, finish: str | None = None) -> dict[str, Any]:
    if chat:
        return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    return {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}


def _frame(
    head: dict[str, Any], choice: dict[str, Any] | None = None, stored: bytes = b""
) -> bytes:
    """One chunk; its integers past 64 bits as the `stored` answer has them."""
    chunk = head if choice is None else {**head, "choices": [choice]}
    content = orjson.dumps(chunk)
    return b"data: " + (as_written(content, chunk, stored) if stored else content) + b"\n\n"


def _pieces(text: str) -> list[str]:
    """`text` cut after a space near every _PIECE_CHARS characters; joined back it is `text`."""
    pieces: list[str] = []
    start = 0
    while len(text) - start > _PIECE_CHARS:
        cut = text.rfind(" ", start + 1, start + _PIECE_CHARS)
        end = cut + 1 if cut > start else start + _PIECE_CHARS
        pieces.append(text[start:end])
        start = end
    if start < len(text):
        pieces.append(text[start:])
    return pieces
