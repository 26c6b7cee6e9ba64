"""Pass-through of a named-event stream (Responses, Messages): events go out unchanged; the
text deltas are counted and only the events that carry usage are parsed."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.upstream.partial import EVENT_END, EVENT_ENDS, MAX_HELD_BYTES, Partial, after_last_end

__all__ = ["ANSWER_ID", "EventForwarder", "StreamEvents", "text_pattern", "type_pattern"]

_DATA = b"data:"
ANSWER_ID = "answer_id"
"""Where a UsageReader puts the id its API's ending event gives the answer (Responses: the id
the backend stores it under)."""

UsageReader = Callable[[dict[str, Any], dict[str, Any]], dict[str, Any] | None]
"""The whole usage once one parsed event completes it, else None; the second argument is the
stream's scratch state, for usage that comes in parts (Messages: input first, output last)."""


@dataclass(frozen=True, slots=True)
class StreamEvents:
    """How one API's stream says things: each a regex over an event's `"type"` field."""

    delta: re.Pattern[bytes]  # an event with generated text (a token event)
    # A delta's text, not empty: only the reads that hold it are timed and bound the count.
    text: re.Pattern[bytes]
    # The event that opens an output block or item, and the types of those that are tool
    # calls: such an event, with the call's name, is timed as text (a chat tool call's first
    # event, its name, ends TTFT too), but no token of the count.
    opens: re.Pattern[bytes]
    call: re.Pattern[bytes]
    usage: re.Pattern[bytes]  # an event with usage in it, or one of `failures`
    completes: re.Pattern[bytes]  # the event whose usage is the whole one (without it, none)
    last: re.Pattern[bytes]  # the event that ends the stream
    read_usage: UsageReader
    failures: frozenset[str]  # the types of events that say the answer failed


def text_pattern(keys: str) -> re.Pattern[bytes]:
    """A regex matching a non-empty string under one of `keys` (a regex alternation)."""
    return re.compile(rb'"(?:' + keys.encode() + rb')":\s*"(?!")')


def type_pattern(types: str) -> re.Pattern[bytes]:
    """A regex matching `"type":"<one of types>"` (a regex alternation) as JSON writes it."""
    return re.compile(rb'"type":\s*"(?:' + types.encode() + rb')"')


_NAME = text_pattern("name")  # a non-empty name: a tool call's, in the event that opens it


class EventForwarder:
    """Cuts an upstream byte stream at event boundaries and returns what may be forwarded.

    Same contract as SSEForwarder: `feed` gives the bytes to write now and how many of their
    events carry generated text, `finish` what is left at the end, `usage` the backend's usage
    (in the API's own names); `failed` says an event of the backend's said the answer failed.
    The ending event is held back for `finish`, so the request is settled before the client
    reads it (as [DONE] is on chat streams); so is the event that completes the usage when
    `believed` does not believe it, or that has none (`held`, its JSON `held_event`), for the
    answer's end to show the usage billed in its place.
    """

    __slots__ = ("_believed", "_ended", "_events", "_held", "_partial", "_parts", "_tail",
                 "failed", "held", "held_event", "texted", "usage")  # fmt: skip

    def __init__(
        self, events: StreamEvents, believed: Callable[[dict[str, Any]], object] | None = None
    ) -> None:
        self._events = events
        self._believed = believed
        self.held = b""
        self.held_event: dict[str, Any] | None = None
        self._partial = Partial()  # an event's start, until a read ends it
        self._tail = b""  # whole events held back: the ending one (and any after it)
        self._held = 0  # text events in `_tail`, counted when it was held
        self._parts: dict[str, Any] = {}
        self._ended = False  # the ending event was held back once
        self.texted = False  # the last bytes `feed` returned hold text, not only empty deltas
        self.usage: dict[str, Any] | None = None
        self.failed = False  # the backend said, in an event, that the answer failed

    def feed(self, data: bytes) -> tuple[bytes, int]:
        if self._partial.size:
            whole = self._partial.take(data, EVENT_ENDS)
            if whole is None:
                return b"", 0
            data = whole
        if self._tail:
            data = self._tail + data
            self._tail = b""
        cut = len(data) if data.endswith(EVENT_ENDS) else after_last_end(data)
        if cut < 0:
            if len(data) > MAX_HELD_BYTES:
                count = self._count(data)
                self.texted = count > 0
                return data, count
            self._partial.start(data)
            return b"", 0
        out = data[:cut]
        if cut < len(data):
            self._partial.start(data[cut:])
        events = self._events
        if events.usage.search(out) is not None:
            out = self._read_usage(out)
        # Text events count when they come: the held ones then, not again when they go out.
        count, self._held = self._count(out) - self._held, 0
        # A count is of the deltas with text; a read without, searched once for a tool call's
        # name (the event that opens it is rare: one a content block or output item).
        self.texted = count > 0 or (
            events.opens.search(out) is not None and self._names_a_call(out)
        )
        # Held back once: events a backend sends after its ending one go out as they come,
        # the held ending with them (as chat's [DONE] does), never held again and again (which
        # kept every later byte and scanned it all anew on each read).
        last = None if self._ended else events.last.search(out)
        if last is not None:
            self._ended = True
            start = max(0, after_last_end(out, 0, last.start()))
            out, self._tail = out[:start], out[start:]
            self._held = self._count(self._tail)
        return out, count

    @property
    def answer_id(self) -> object:
        """The answer's id as its ending event gave it (anything: the backend's JSON), if one
        did."""
        return self._parts.get(ANSWER_ID)

    def cut_short(self) -> bool:
        """Whether the stream, as far as it came, lacks both its ending event and an error event
        of the backend's: a backend that closed it cleanly mid-way, whose client would take what
        it has as the whole answer. An ending event held to show the bill (Responses' is the
        one that completes its usage) counts, as does one missing only its blank line."""
        if self._ended or self.failed:
            return False
        return self._events.last.search(self.held + self._partial.peek()) is None

    def finish(self) -> bytes:
        tail, self._tail = self.held + self._tail, b""
        return tail + self._partial.drain() if self._partial.size else tail

    def _names_a_call(self, out: bytes) -> bool:
        """Whether an event of `out` opens a tool call by its name (not any event that mentions
        a name: a Responses stream's first event echoes the request's tools, a list of MCP
        tools names each)."""
        events = self._events
        return any(
            events.opens.search(event) is not None
            and events.call.search(event) is not None
            and _NAME.search(event) is not None
            for event in EVENT_END.split(out)
        )

    def _count(self, out: bytes) -> int:
        """The text events in `out`: its deltas, but no more than the non-empty texts in it (an
        empty delta beside text in one read is no token)."""
        deltas = len(self._events.delta.findall(out))
        return min(deltas, len(self._events.text.findall(out))) if deltas else 0

    def _read_usage(self, out: bytes) -> bytes:
        """`out` (whole events), less the event that completes a usage not believed; one held
        from an earlier read goes out first when another takes its place."""
        earlier, start = self.held, 0
        held: tuple[int, int] | None = None
        for end in EVENT_END.finditer(out):
            event, at, start = out[start : end.start()], start, end.end()
            if self._events.usage.search(event) is None:
                continue
            payload = b"".join(
                line[len(_DATA) :].strip() for line in event.splitlines() if line.startswith(_DATA)
            )
            try:
                parsed = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(parsed, dict):
                continue
            if parsed.get("type") in self._events.failures:
                self.failed = True
            found = self._events.read_usage(parsed, self._parts)
            if found is not None:
                self.usage = found
            if self._believed is None:
                continue
            if (
                not self._believed(found)
                if found is not None
                else self._events.completes.search(event) is not None  # it has none
            ):
                self.held, self.held_event, held = out[at:start], parsed, (at, start)
        if held is None:
            return out
        return earlier + out[: held[0]] + out[held[1] :]
