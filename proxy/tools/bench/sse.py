"""Incremental SSE parsing for bench streams, and cheap looks into chat-completion chunks.

Bytes in, events out, whatever the read boundaries; JSON is parsed only for events that need it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import orjson

__all__ = [
    "SseEvent",
    "SseParser",
    "content_text",
    "error_message",
    "has_content",
    "is_done",
    "usage_completion_tokens",
]

# A token-bearing field with a non-empty string value. Generated text that merely mentions such
# a key cannot match: inside a JSON string its quotes are escaped as \".
_CONTENT_RE = re.compile(rb'"(?:content|reasoning_content|reasoning|text|arguments)"\s*:\s*"[^"]')
_USAGE_RE = re.compile(rb'"usage"\s*:\s*\{')
_TEXT_KEYS = ("content", "reasoning_content", "reasoning", "text")


@dataclass(slots=True)  # not frozen: frozen __init__ costs ~3x, and this is made per event
class SseEvent:
    """One dispatched event: its `event:` type (b"" when absent) and its joined `data:` lines."""

    data: bytes
    event: bytes = b""


class SseParser:
    """Feed raw bytes as they arrive; get back the events they complete (LF, CRLF or CR lines)."""

    __slots__ = ("_buffer", "_scan_from")

    def __init__(self) -> None:
        self._buffer = b""
        self._scan_from = 0

    def feed(self, chunk: bytes) -> list[SseEvent]:
        buffer = self._buffer + chunk if self._buffer else chunk
        if buffer.find(b"\r") >= 0:  # not `in`: see proxy/cache/template.py plain
            buffer = _normalize_newlines(buffer)
        events: list[SseEvent] = []
        start = 0
        end = buffer.find(b"\n\n", self._scan_from)
        while end >= 0:
            event = _parse_block(buffer[start:end])
            if event is not None:
                events.append(event)
            start = end + 2
            end = buffer.find(b"\n\n", start)
        self._buffer = buffer[start:]
        # Resume the search just before the old end: a split "\n\n" or "\r\n" straddles it.
        self._scan_from = max(0, len(self._buffer) - 2)
        return events

    def flush(self) -> list[SseEvent]:
        """At end of stream: the last event, even if the server never sent its blank line."""
        tail = self._buffer.replace(b"\r", b"\n").strip(b"\n")
        self._buffer = b""
        self._scan_from = 0
        if not tail:
            return []
        return self.feed(tail + b"\n\n")


def _normalize_newlines(buffer: bytes) -> bytes:
    buffer = buffer.replace(b"\r\n", b"\n")
    if buffer.endswith(b"\r"):
        # May be the first half of a CRLF whose LF is in the next read: keep it for then.
        return buffer[:-1].replace(b"\r", b"\n") + b"\r"
    return buffer.replace(b"\r", b"\n")


def _parse_block(block: bytes) -> SseEvent | None:
    if block.startswith(b"data: ") and block.find(b"\n") < 0:  # the common one-line event
        return SseEvent(data=block[6:])
    data_lines: list[bytes] = []
    event_type = b""
    for line in block.split(b"\n"):
        if not line or line[0] == 0x3A:  # empty, or a ":" comment such as a keep-alive
            continue
        field, _, value = line.partition(b":")
        if value[:1] == b" ":
            value = value[1:]
        if field == b"data":
            data_lines.append(value)
        elif field == b"event":
            event_type = value
    if not data_lines:
        return None
    data = data_lines[0] if len(data_lines) == 1 else b"\n".join(data_lines)
    return SseEvent(data=data, event=event_type)


def is_done(data: bytes) -> bool:
    """The OpenAI end-of-stream sentinel."""
    return data == b"[DONE]" or (b"[DONE]" in data and data.strip() == b"[DONE]")


def has_content(data: bytes) -> bool:
    """Whether a chunk carries generated text (content, reasoning, tool-call arguments)."""
    return _CONTENT_RE.search(data) is not None


def usage_completion_tokens(data: bytes) -> int | None:
    """`usage.completion_tokens` of a chunk that has a usage object, else None (no JSON parse)."""
    if b'"usage"' not in data or _USAGE_RE.search(data) is None:
        return None
    try:
        usage = orjson.loads(data).get("usage")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None


def error_message(event: SseEvent) -> str | None:
    """The message of an error event (`event: error` or a top-level "error" object), else None."""
    if event.event != b"error" and b'"error"' not in event.data:
        return None
    try:
        body = orjson.loads(event.data)
    except orjson.JSONDecodeError:
        return event.data.decode("utf-8", "replace")[:200] if event.event == b"error" else None
    if not isinstance(body, dict) or ("error" not in body and event.event != b"error"):
        return None
    error = body.get("error", body)
    message = error.get("message") if isinstance(error, dict) else error
    return str(message)[:200]


def content_text(data: bytes) -> str:
    """All generated text in one chunk; parses JSON, so only for the tokenizer fallback."""
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError:
        return ""
    choices = body.get("choices") if isinstance(body, dict) else None
    parts: list[str] = []
    for choice in choices if isinstance(choices, list) else ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta") or choice.get("message") or choice
        if isinstance(delta, dict):
            parts.extend(_texts_of(delta))
    return "".join(parts)


def _texts_of(delta: dict[str, object]) -> list[str]:
    parts = [value for key in _TEXT_KEYS if isinstance(value := delta.get(key), str)]
    calls = delta.get("tool_calls")
    for call in calls if isinstance(calls, list) else ():
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            parts.append(arguments)
    return parts
