"""A stored answer in one shape for streams and whole responses, built from either, kept compact.

Only complete answers are ever built: a stream without a finish reason and `[DONE]` is not one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

__all__ = ["Answer", "from_response", "from_stream"]


@dataclass(frozen=True, slots=True)
class Answer:
    """`message` is the chat message (role, content, tool_calls...); `text` a completion's text."""

    operation: str
    model: str
    finish_reason: str
    usage: dict[str, Any]
    message: dict[str, Any] | None = None
    text: str | None = None
    system_fingerprint: str | None = None
    expires_wall: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        value = self.usage.get("prompt_tokens")
        return value if isinstance(value, int) else 0

    @property
    def completion_tokens(self) -> int:
        value = self.usage.get("completion_tokens")
        return value if isinstance(value, int) else 0

    def encode(self) -> bytes:
        return orjson.dumps(
            [
                self.operation,
                self.model,
                self.finish_reason,
                self.usage,
                self.message,
                self.text,
                self.system_fingerprint,
                self.expires_wall,
            ]
        )

    @classmethod
    def decode(cls, raw: bytes) -> Answer:
        return cls(*orjson.loads(raw))


def from_response(operation: str, raw: bytes, usage: dict[str, Any]) -> Answer | None:
    """The answer in a whole (non-stream) response body, or None if it is not a plain answer."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    finish = choice.get("finish_reason")
    if not isinstance(finish, str):
        return None
    message = choice.get("message") if operation == "chat" else None
    text = choice.get("text") if operation == "text_completion" else None
    if not isinstance(message, dict) and not isinstance(text, str):
        return None
    fingerprint = body.get("system_fingerprint")
    return Answer(
        operation, str(body.get("model", "")), finish, usage, message, text,
        fingerprint if isinstance(fingerprint, str) else None,
    )  # fmt: skip


def from_stream(operation: str, events: bytes, usage: dict[str, Any]) -> Answer | None:
    """The answer a complete SSE stream carried, merged from its deltas; None if incomplete.

    Runs once per stored miss over every chunk: all payloads are parsed in one orjson call, and
    the usual chunk (one choice, a text delta and nothing else) takes a short path. An event
    split over several `data:` lines is not JSON on its own and makes the stream unstorable.
    """
    payloads = [line[5:].strip() for line in events.splitlines() if line.startswith(b"data:")]
    if not payloads or payloads[-1].rstrip() != b"[DONE]":
        return None
    try:
        chunks = orjson.loads(b"[" + b",".join(payloads[:-1]) + b"]")
    except orjson.JSONDecodeError:
        return None
    merged = _Deltas()
    for chunk in chunks:
        if not isinstance(chunk, dict):
            return None
        if merged.add_text(chunk):
            continue
        if "error" in chunk or not merged.add(chunk):
            return None
    if merged.finish_reason is None:
        return None
    return merged.answer(operation, usage)


class _Deltas:
    """Stream chunks folded into one message: text concatenated, tool calls merged by index."""

    def __init__(self) -> None:
        self.model = ""
        self.fingerprint: str | None = None
        self.finish_reason: str | None = None
        self.texts: dict[str, list[str]] = {}
        self.tools: dict[int, dict[str, Any]] = {}

    def add_text(self, chunk: dict[str, Any]) -> bool:
        """Fold in a chunk that only carries text for choice 0; False for any other chunk."""
        choices = chunk.get("choices")
        if not choices or len(choices) != 1:
            return False
        choice = choices[0]
        delta = choice.get("delta")
        if choice.get("finish_reason") is not None or choice.get("index", 0) != 0:
            return False
        if delta is None:  # a text completion's chunk
            piece, name = choice.get("text"), "text"
        elif len(delta) == 1 and "content" in delta:
            piece, name = delta["content"], "content"
        else:
            return False
        if not isinstance(piece, str):
            return False
        self.texts.setdefault(name, []).append(piece)
        self.model = self.model or chunk.get("model") or ""
        return True

    def add(self, chunk: dict[str, Any]) -> bool:
        """Fold one chunk in; False if it is not a one-choice answer's chunk."""
        self.model = chunk.get("model") or self.model
        self.fingerprint = chunk.get("system_fingerprint") or self.fingerprint
        choices = chunk.get("choices") or []
        if len(choices) > 1 or any(c.get("index", 0) != 0 for c in choices):
            return False
        for choice in choices:
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                delta = {"text": choice.get("text")}
            for name in ("content", "reasoning_content", "refusal", "text"):
                piece = delta.get(name)
                if isinstance(piece, str):
                    self.texts.setdefault(name, []).append(piece)
            for call in delta.get("tool_calls") or []:
                self._add_tool_call(call)
        return True

    def _add_tool_call(self, call: dict[str, Any]) -> None:
        merged = self.tools.setdefault(
            int(call.get("index", 0)), {"id": "", "type": "function", "function": {}}
        )
        merged["id"] = call.get("id") or merged["id"]
        merged["type"] = call.get("type") or merged["type"]
        function = call.get("function") or {}
        target = merged["function"]
        if function.get("name"):
            target["name"] = function["name"]
        target["arguments"] = target.get("arguments", "") + (function.get("arguments") or "")

    def answer(self, operation: str, usage: dict[str, Any]) -> Answer:
        finish = self.finish_reason or "stop"
        if operation == "text_completion":
            text = "".join(self.texts.get("text", []))
            return Answer(operation, self.model, finish, usage, None, text, self.fingerprint)
        message: dict[str, Any] = {"role": "assistant", "content": None}
        for name in ("content", "reasoning_content", "refusal"):
            if name in self.texts:
                message[name] = "".join(self.texts[name])
        if self.tools:
            message["tool_calls"] = [self.tools[i] for i in sorted(self.tools)]
        return Answer(operation, self.model, finish, usage, message, None, self.fingerprint)
