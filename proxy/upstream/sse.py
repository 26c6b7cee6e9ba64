"""SSE pass-through: forward whole events unchanged; find the usage chunk without parsing others."""

from __future__ import annotations

import re
from typing import Any

import orjson

from proxy.upstream.partial import MAX_HELD_BYTES, Partial

__all__ = ["SSEForwarder"]

# An event that carries generated text: a non-empty content/text/arguments string.
_TOKEN = re.compile(rb'"(?:content|text|reasoning_content|arguments)":\s*"(?!")')
_USAGE_MARK = b'"prompt_tokens"'
_DATA = b"data:"
_DONE = b"[DONE]"
# How the [DONE] event ends, by separator: looked up per read, never built.
_DONE_ENDS = {b"\n\n": _DONE + b"\n\n", b"\r\n\r\n": _DONE + b"\r\n\r\n"}


class SSEForwarder:
    """Cuts an upstream byte stream at event boundaries and returns what may be forwarded.

    Reads that end on an event boundary (the usual case) pass through as the same bytes object;
    only a read that splits an event keeps its tail back until the event is whole. Only events
    that mention `prompt_tokens` (the usage chunk) are parsed.
    """

    __slots__ = ("_keep_usage", "_partial", "_saw_token", "_sep", "_tail", "_textless", "usage")

    def __init__(self, *, keep_usage: bool) -> None:
        self._keep_usage = keep_usage
        self._sep: bytes | None = None
        self._partial = Partial()  # an event's start, until a read ends it
        self._tail = b""  # whole events held back: [DONE]
        self._saw_token = False
        self._textless = 0
        self.usage: dict[str, Any] | None = None

    def feed(self, data: bytes) -> tuple[bytes, int]:
        """Bytes to write now (maybe empty), and how many of their events carry generated text."""
        if self._partial.size:
            whole = self._partial.take(data, (self._sep or b"\n",))  # sep unknown: a line
            if whole is None:
                return b"", 0
            data = whole
        tail = self._tail
        if tail:
            data = tail + data
        sep = self._sep or self._detect_separator(data)
        if data.endswith(sep):  # the usual read: whole events, nothing to hold back
            out = data
            if tail:
                self._tail = b""
        else:
            cut = data.rfind(sep)
            self._tail = b""
            if cut < 0:
                if len(data) > MAX_HELD_BYTES:
                    return data, 0
                self._partial.start(data)
                return b"", 0
            cut += len(sep)
            out = data[:cut]
            self._partial.start(data[cut:])
        self._textless = 0
        if out.endswith(_DONE_ENDS[sep]):
            # [DONE] goes out with the response's end (`finish`), after the request is settled:
            # a client that asks again the moment it reads [DONE] finds its slot free.
            done = out.rfind(_DATA)
            out, self._tail = out[:done], out[done:] + self._tail
        if out.find(_USAGE_MARK) >= 0:  # not `in`: see proxy/cache/template.py plain
            out = self._take_usage(out, sep)
        if self._saw_token:  # after the first token (nearly every read): no call for the count
            return out, out.count(_DATA) - self._textless
        return out, self._token_events(out)

    def _detect_separator(self, data: bytes) -> bytes:
        """CRLF or LF line ends, decided by the first line end the backend sends."""
        newline = data.find(b"\n")
        if newline < 0:
            return b"\n\n"  # undecided yet: no boundary can be found in `data` either way
        crlf = newline > 0 and data[newline - 1] == 0x0D
        self._sep = b"\r\n\r\n" if crlf else b"\n\n"
        return self._sep

    def finish(self) -> bytes:
        """What is left when the upstream ends: the [DONE] event, or an unterminated last event,
        forwarded as is."""
        tail, self._tail = self._tail, b""
        return tail + self._partial.drain() if self._partial.size else tail

    def _token_events(self, out: bytes) -> int:
        """Until the first token: the events from the first one with text on count as tokens,
        bar a usage-only one ([DONE] never reaches here: `feed` holds it back). After it, `feed`
        counts every data event but the usage-only ones."""
        first = _TOKEN.search(out)
        if first is None:
            return 0
        self._saw_token = True
        start = out.rfind(_DATA, 0, first.start())
        return out.count(_DATA, max(start, 0)) - self._textless

    def _take_usage(self, out: bytes, sep: bytes) -> bytes:
        """`out` (whole events, so it ends with `sep`) with each event that mentions usage as
        `_usage_event` leaves it; every other event as it came. Only those events are cut out: a
        read that holds a whole stream (an unpaced backend) is not walked an event at a time."""
        kept: list[bytes] = []
        copied = 0  # where the bytes not yet in `kept` begin
        mark = out.find(_USAGE_MARK)
        while mark >= 0:
            start = out.rfind(sep, copied, mark)
            start = copied if start < 0 else start + len(sep)
            end = out.find(sep, mark)  # found: `out` ends with `sep`
            event = self._usage_event(out[start:end])
            kept.append(out[copied:start])
            if event:
                kept.append(event + sep)
            copied = end + len(sep)
            mark = out.find(_USAGE_MARK, copied)
        kept.append(out[copied:])
        return b"".join(kept)

    def _usage_event(self, event: bytes) -> bytes:
        """Record the usage; return the event as the client should see it (b"" to drop it)."""
        payload = b"".join(
            line[len(_DATA) :].strip() for line in event.splitlines() if line.startswith(_DATA)
        )
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return event
        usage = chunk.get("usage") if isinstance(chunk, dict) else None
        if not isinstance(usage, dict):
            return event
        self.usage = usage
        if not chunk.get("choices"):
            if self._keep_usage:
                self._textless += 1
                return event
            return b""
        if self._keep_usage:
            return event
        chunk["usage"] = None
        return b"data: " + orjson.dumps(chunk)
