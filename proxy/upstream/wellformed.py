"""Only well-formed answers pass as 200: a whole answer must be a JSON object of the operation's
shape, a stream must be `text/event-stream` whose first event is a `data:` JSON object."""

from __future__ import annotations

import json
import re
from typing import Any, Final

import orjson

from proxy.context import Operation
from proxy.upstream.partial import EVENT_ENDS, Partial

__all__ = [
    "EVENT_STREAM",
    "FirstEvent",
    "MalformedAnswer",
    "leniently",
    "read_answer",
    "whole_answer",
]

EVENT_STREAM: Final = "text/event-stream"

# The list an answer of each operation must carry; other fields are the backend's business.
_LIST_FIELD: Final[dict[str, str]] = {
    "chat": "choices",
    "text_completion": "choices",
    "embeddings": "data",
    "responses": "output",
    "messages": "content",
}
_DATA: Final = b"data:"
_SURROGATE: Final = re.compile("[\ud800-\udfff]")
# A stream's first event comes within this many bytes (SSEForwarder holds at most as much).
_FIRST_EVENT_LIMIT_BYTES: Final = 1 << 20
# The largest answer read again by Python's JSON reader where orjson refused it: 150 ms for
# 5 MB, on the event loop.
_LENIENT_LIMIT_BYTES: Final = 1 << 20


class MalformedAnswer(ValueError):
    """What is wrong with a whole 2xx answer."""


def whole_answer(operation: Operation, raw: bytes) -> dict[str, Any]:
    """A whole 2xx answer for `operation`, parsed once for every reader (usage, the cache);
    MalformedAnswer says what is wrong if it has not the operation's shape."""
    return read_answer(operation, raw)[0]


def read_answer(operation: Operation, raw: bytes) -> tuple[dict[str, Any], bool]:
    """`whole_answer`, and whether orjson read it (False: Python's reader did, what it read
    changed: a lone surrogate is U+FFFD, so no stored copy may stand for it)."""
    strict = True
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        parsed, strict = leniently(raw), False
    if not isinstance(parsed, dict):
        raise MalformedAnswer(f"is JSON but not an object ({_preview(raw)})")
    field = _LIST_FIELD[operation]
    if not isinstance(parsed.get(field), list):
        raise MalformedAnswer(f"has no {field!r} list ({_preview(raw)})")
    return parsed, strict


def leniently(raw: bytes) -> Any:
    """An answer orjson refuses that clients' JSON readers take (Python's, the openai SDK's;
    JavaScript's): `NaN`, `Infinity`, a number past a double, a lone surrogate's escape. Such an
    answer reached no client (a 502) and was billed nothing though a backend made it; it is
    relayed as it came now, its usage checked as any other. Read only when orjson refuses, and
    only up to 1 MiB (past it, a 502 as before)."""
    if len(raw) > _LENIENT_LIMIT_BYTES:
        raise MalformedAnswer(f"is not JSON to orjson, past 1 MiB ({_preview(raw)})")
    try:
        parsed = json.loads(raw)
    except (ValueError, RecursionError):  # no JSON at all, or nested past Python's reader
        raise MalformedAnswer(f"is not JSON ({_preview(raw)})") from None
    return _without_surrogates(parsed)


def _without_surrogates(parsed: Any) -> Any:
    """`parsed` with each lone surrogate as U+FFFD, in keys and strings alike: the tokenizers
    that count the answer, and orjson, take no such string (the client gets the bytes as they
    came). Walked level by level: Python's reader nests deeper than its own recursion."""
    if not isinstance(parsed, list | dict):
        return _scrubbed(parsed) if isinstance(parsed, str) else parsed
    pending: list[list[Any] | dict[str, Any]] = [parsed]
    while pending:
        item = pending.pop()
        if isinstance(item, list):
            item[:] = [_scrubbed_member(member, pending) for member in item]
        else:
            pairs = [(_scrubbed(key), _scrubbed_member(v, pending)) for key, v in item.items()]
            item.clear()
            item.update(pairs)
    return parsed


def _scrubbed_member(member: Any, pending: list[list[Any] | dict[str, Any]]) -> Any:
    if isinstance(member, str):
        return _scrubbed(member)
    if isinstance(member, list | dict):
        pending.append(member)
    return member


def _scrubbed(text: str) -> str:
    return _SURROGATE.sub("\ufffd", text)


class FirstEvent:
    """Reads the start of a stream until its first `data:` event is whole, then judges it: a JSON
    object, or `problem` says what it is. Comments before it are allowed, within `limit_bytes`."""

    __slots__ = ("_limit", "_partial", "_seen", "decided", "problem")

    def __init__(self, limit_bytes: int = _FIRST_EVENT_LIMIT_BYTES) -> None:
        self._partial = Partial()  # an event not yet ended, and the reads after it
        self._seen = 0
        self._limit = limit_bytes
        self.decided = False
        self.problem: str | None = None

    def feed(self, raw: bytes) -> bool:
        """True once the first event is judged. Held bytes are looked at again only once a read
        ends an event, so a backend that trickles its first event costs work in proportion to
        its bytes."""
        if self._partial.size:
            whole = self._partial.take(raw, EVENT_ENDS)
            if whole is None:
                return self._counted(raw)
        else:
            whole = raw
        held = whole.replace(b"\r\n", b"\n")
        start = 0
        end = held.find(b"\n\n")
        while end >= 0:  # event by event up to the first with data, not the whole read
            lines = [line for line in held[start:end].split(b"\n") if line.startswith(_DATA)]
            if lines:
                self._judge(b"\n".join(line[len(_DATA) :].strip() for line in lines))
                return True
            start = end + 2
            end = held.find(b"\n\n", start)
        if start < len(held):
            self._partial.start(held[start:])
        return self._counted(raw)

    def _counted(self, raw: bytes) -> bool:
        self._seen += len(raw)
        if self._seen > self._limit:
            self._decide(f"it sent no data event in its first {self._limit} bytes")
            return True
        return False

    def end(self) -> None:
        """The stream ended before its first event was whole."""
        if not self.decided:
            self._decide("it ended without a data event")

    def _judge(self, payload: bytes) -> None:
        try:
            parsed = orjson.loads(payload)
        except orjson.JSONDecodeError:
            try:  # what a client reads, as a whole answer's (`leniently`); only judged here
                parsed = json.loads(payload)
            except (ValueError, RecursionError):
                self._decide(f"its first event is not JSON ({_preview(payload)})")
                return
        if not isinstance(parsed, dict):
            self._decide(f"its first event is not a JSON object ({_preview(payload)})")
            return
        self._decide(None)

    def _decide(self, problem: str | None) -> None:
        self.decided = True
        self.problem = problem
        self._partial.drain()  # what was held is not needed any more


def _preview(raw: bytes) -> str:
    text = raw[:80].decode("utf-8", "replace")
    return repr(text + "...") if len(raw) > 80 else repr(text)
