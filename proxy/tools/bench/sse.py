"""Incremental SSE parsing for bench streams, and cheap looks into chat-completion chunks.

Bytes in, events out, whatever the read boundaries; JSON is parsed only for events that need it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

__all__ = [
    "MAX_EVENT_BYTES",
    "MAX_USAGE_TOKENS",
    "SseEvent",
    "SseParser",
    "content_text",
    "error_message",
    "has_content",
    "has_reasoning",
    "is_done",
    "usage_completion_tokens",
    "usage_reasoning_tokens",
]

# A token-bearing field with a non-empty string value: a tool call's function `name` too (its
# first event, before any arguments). Generated text that merely mentions such a key cannot
# match: inside a JSON string its quotes are escaped as \".
_CONTENT_RE = re.compile(
    rb'"(?:content|reasoning_content|reasoning|refusal|text|name|arguments)"\s*:\s*"[^"]'
)
_REASONING_RE = re.compile(rb'"(?:reasoning_content|reasoning)"\s*:\s*"[^"]')
_USAGE_RE = re.compile(rb'"usage"\s*:\s*\{')
_TEXT_KEYS = ("content", "reasoning_content", "reasoning", "refusal", "text")
# An event longer than this is dropped unparsed (SseParser.dropped); no chat chunk comes near.
MAX_EVENT_BYTES = 16 << 20
# The most output tokens a `usage` is believed for (the gateway's bound too): a larger count,
# a negative one, a float or a bool is no count.
MAX_USAGE_TOKENS = 100_000_000
# A held event start shorter than this is joined to each read and searched again (as cheap as
# it gets for the usual start of a few bytes); a longer one is kept in pieces.
_JOIN_BELOW = 1 << 16
# A blank line, however lines end: LF LF, CR CR, or an LF then a CR (alone or a CRLF's).
_BLANK_LINES = (b"\n\n", b"\r\r", b"\n\r")


@dataclass(slots=True)  # not frozen: frozen __init__ costs ~3x, and this is made per event
class SseEvent:
    """One dispatched event: its `event:` type (b"" when absent) and its joined `data:` lines."""

    data: bytes
    event: bytes = b""


class SseParser:
    """Feed raw bytes as they arrive; get back the events they complete (LF, CRLF or CR lines).

    A long event's start is held as it was read, and only each new read (and the bytes before
    it) is searched for the blank line that ends it: an endpoint that trickles one long event
    costs work in proportion to its bytes. An event longer than MAX_EVENT_BYTES is dropped unparsed
    (`dropped` counts them), so an endpoint that never ends one cannot grow the bench's memory.
    """

    __slots__ = ("_held", "_size", "_skipping", "dropped")

    def __init__(self) -> None:
        self._held: list[bytes] = []  # an event's start (its last byte, when skipping)
        self._size = 0
        self._skipping = False  # inside an event longer than MAX_EVENT_BYTES
        self.dropped = 0

    def feed(self, chunk: bytes) -> list[SseEvent]:
        held = self._held
        if held and chunk:
            if self._skipping:  # holding only the dropped event's last byte
                at = _blank_line_at(held[0] + chunk)
                if at < 0:
                    self._held = [chunk[-1:]]
                    return []
                # The dropped event's last line ends at `at`; a blank line, then new events.
                self._skipping = False
                chunk = (held[0] + chunk)[at + 1 :]
            elif self._size < _JOIN_BELOW:  # a short start (one piece): joined, searched again
                chunk = held[0] + chunk
            # A long one: the read and the held bytes' end (a line end there and one at the
            # read's start are a blank line; so is a held LF, CR: its CR was kept in case an
            # LF came next) are searched, and the start joined only once its end is here.
            elif _has_blank_line(held[-1][-2:] + chunk[:1]) or _has_blank_line(chunk):
                chunk = b"".join(held) + chunk
            else:
                self._hold(chunk)
                return []
            self._held, self._size = [], 0
        buffer = chunk
        if buffer.find(b"\r") >= 0:  # not `in`: see proxy/cache/template.py plain
            buffer = _normalize_newlines(buffer)
        events: list[SseEvent] = []
        start = 0
        end = buffer.find(b"\n\n")
        while end >= 0:
            event = _parse_block(buffer[start:end])
            if event is not None:
                events.append(event)
            start = end + 2
            end = buffer.find(b"\n\n", start)
        if start < len(buffer):
            self._hold(buffer[start:] if start else buffer)
        return events

    def flush(self) -> list[SseEvent]:
        """At end of stream: the last event, even if the server never sent its blank line."""
        held, skipping = b"".join(self._held), self._skipping
        self._held, self._size, self._skipping = [], 0, False
        tail = _normalize_newlines(held).replace(b"\r", b"\n").strip(b"\n")  # a last CR too
        if skipping or not tail:
            return []
        return self.feed(tail + b"\n\n")

    def _hold(self, data: bytes) -> None:
        self._size += len(data)
        if self._size <= MAX_EVENT_BYTES:
            self._held.append(data)
            return
        self.dropped += 1
        self._held, self._size, self._skipping = [data[-1:]], 0, True


def _has_blank_line(data: bytes) -> bool:
    return data.find(b"\n\n") >= 0 or data.find(b"\r\r") >= 0 or data.find(b"\n\r") >= 0


def _blank_line_at(data: bytes) -> int:
    """Where the first blank line's first line end is in `data`, or -1."""
    found = [at for blank in _BLANK_LINES if (at := data.find(blank)) >= 0]
    return min(found, default=-1)


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


def has_reasoning(data: bytes) -> bool:
    """Whether a chunk carries reasoning text (a reasoning model's thinking, streamed)."""
    return data.find(b'"reasoning') >= 0 and _REASONING_RE.search(data) is not None


def _usage_of(data: bytes) -> dict[str, Any] | None:
    if b'"usage"' not in data or _USAGE_RE.search(data) is None:
        return None
    try:
        usage = orjson.loads(data).get("usage")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None


def _count(value: object) -> int | None:
    return value if type(value) is int and 0 <= value <= MAX_USAGE_TOKENS else None


def usage_completion_tokens(data: bytes) -> int | None:
    """`usage.completion_tokens` of a chunk that has a usage object, else None (no JSON parse);
    None too for a count no answer can have (see MAX_USAGE_TOKENS)."""
    usage = _usage_of(data)
    return None if usage is None else _count(usage.get("completion_tokens"))


def usage_reasoning_tokens(data: bytes) -> int:
    """`usage.completion_tokens_details.reasoning_tokens` of a usage chunk, else 0."""
    usage = _usage_of(data)
    details = None if usage is None else usage.get("completion_tokens_details")
    tokens = _count(details.get("reasoning_tokens")) if isinstance(details, dict) else None
    return tokens or 0


def error_message(event: SseEvent) -> str | None:
    """The message of an error event (`event: error` or a top-level "error" that is not null)."""
    typed = event.event == b"error"
    if not typed and b'"error"' not in event.data:
        return None
    try:
        body = orjson.loads(event.data)
    except orjson.JSONDecodeError:
        body = None
    # Some servers send `"error": null` in every chunk and answer: that is no error.
    error = body.get("error") if isinstance(body, dict) else None
    if error is None:
        if not typed:
            return None
        error = body
    message = error.get("message") if isinstance(error, dict) else error
    if message is None:  # no message to show: the event as sent
        return event.data.decode("utf-8", "replace")[:200]
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
        if isinstance(function, dict):
            parts.extend(v for k in ("name", "arguments") if isinstance(v := function.get(k), str))
    return parts
