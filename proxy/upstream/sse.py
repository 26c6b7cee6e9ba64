"""SSE pass-through: forward whole events unchanged; find the usage chunk without parsing others."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import orjson

from proxy.jsontext import json_text
from proxy.upstream.exactints import as_written
from proxy.upstream.partial import EVENT_END, EVENT_ENDS, MAX_HELD_BYTES, Partial, after_last_end
from proxy.upstream.wellformed import MalformedAnswer, leniently

__all__ = ["Believed", "ChoicesForwarder", "SSEForwarder"]

Believed = Callable[[dict[str, Any]], object]
"""Whether a backend's usage (in its API's own names) is believed: a true value if it is."""

# An event that carries generated text: a non-empty content/text/reasoning/arguments string
# (`reasoning` is vLLM's name since 0.11, and OpenRouter's and Ollama's).
_TOKEN = re.compile(rb'"(?:content|text|reasoning(?:_content)?|arguments)":\s*"(?!")')
# Generated text for the timing (TTFT, gaps): those, a tool call's name (its first event, before
# any arguments) and a refusal too, as `tokenweir bench` times them. The token count behind the
# bill's estimate starts at `_TOKEN` still.
_TEXT = re.compile(rb'"(?:content|text|reasoning(?:_content)?|arguments|name|refusal)":\s*"(?!")')
_QUOTE = ord('"')
_NO_HEAD = b"\0"  # no read starts with it: searched until a head is learned
_USAGE_MARK = b'"prompt_tokens"'
_DATA = b"data:"
_DATA_LINE = re.compile(rb"(?m)^data:")
_CHOICE = re.compile(rb'"choices"\s*:\s*\[\s*\{')
# The [DONE] event's end, in LF or CRLF lines or both: looked up per read, never built.
_DONE = b"[DONE]"
# A choice's finish_reason, set (null is no string).
_FINISHED = re.compile(rb'"finish_reason"\s*:\s*"')
_DONE_ENDS = tuple(b"[DONE]" + a + b for a in (b"\n", b"\r\n") for b in (b"\n", b"\r\n"))


class SSEForwarder:
    """Cuts an upstream byte stream at event boundaries and returns what may be forwarded.

    Reads that end on an event boundary (the usual case) pass through as the same bytes object;
    only a read that splits an event keeps its tail back until the event is whole. Only events
    that mention `prompt_tokens` (the usage chunk) are parsed. A usage chunk the client asked for
    whose usage `believed` does not believe is `held` (its JSON `held_chunk`) until `finish`,
    for the answer's end to show the usage billed in its place (with `hold`, every usage chunk
    is: the gateway's count may overrule a believed one); one in a chunk with choices goes on
    without it, and `unshown` says the stream's end owes the client a usage chunk. One believed
    there goes on with it: `passed` says so (the bill may still overrule it).
    """

    __slots__ = ("_believed", "_hold", "_keep_usage", "_partial", "_saw_token", "_tail",
                 "_text_at", "_text_head", "_textless", "held", "held_chunk", "passed", "texted",
                 "unshown", "usage")  # fmt: skip

    def __init__(
        self, *, keep_usage: bool, believed: Believed | None = None, hold: bool = False
    ) -> None:
        self._keep_usage = keep_usage
        self._believed = believed
        self._hold = hold
        self.held = b""
        self.held_chunk: Any = None
        self.unshown = self.passed = False
        self._partial = Partial()  # an event's start, until a read ends it
        self._tail = b""  # whole events held back: [DONE]
        self._saw_token = False
        self._textless = 0
        # The last event seen with text, up to its text (`_text_at` bytes): the next one with
        # text is most often the same bytes up to there (id, model, choice, key) then its text.
        self._text_head = _NO_HEAD
        self._text_at = 0
        self.texted = False  # whether the bytes `feed` returned last hold generated text
        self.usage: dict[str, Any] | None = None

    def feed(self, data: bytes) -> tuple[bytes, int]:
        """Bytes to write now (maybe empty), and how many of their events count as tokens (the
        bill's estimate): after the first token every data event but usage alone, textless or
        not. `texted` says whether they hold generated text (what is timed)."""
        if self._partial.size:
            whole = self._partial.take(data, EVENT_ENDS)
            if whole is None:
                return b"", 0
            data = whole
        tail = self._tail
        if tail:
            data = tail + data
        if data.endswith(EVENT_ENDS):  # the usual read: whole events, nothing to hold back
            out = data
            if tail:
                self._tail = b""
        else:
            cut = after_last_end(data)
            self._tail = b""
            if cut < 0:
                if len(data) > MAX_HELD_BYTES:
                    self.texted = False
                    return data, 0
                self._partial.start(data)
                return b"", 0
            out = data[:cut]
            self._partial.start(data[cut:])
        self._textless = 0
        if out.endswith(_DONE_ENDS):
            # [DONE] goes out with the response's end (`finish`), after the request is settled:
            # a client that asks again the moment it reads [DONE] finds its slot free.
            done = out.rfind(_DATA)
            out, self._tail = out[:done], out[done:] + self._tail
        if out.find(_USAGE_MARK) >= 0:  # not `in`: see proxy/cache/template.py plain
            out = self._take_usage(out)
        if self._saw_token:  # after the first token (nearly every read): no count by search
            lines = out.count(_DATA)
            # Text where the last text began (one comparison, no search, nothing allocated;
            # whole events go on past the head, which begins with `data:`), else searched for:
            # a read whose events changed their shape, or hold no text.
            if out.startswith(self._text_head) and out[self._text_at] != _QUOTE:
                self.texted = True
                if lines != 1:  # not the usual read: one data event
                    lines = _data_events(out, lines)
                return out, lines - self._textless
            if lines != 1 or not out.startswith(_DATA):
                lines = _data_events(out, lines)
            self.texted = self._search_text(out)
            return out, lines - self._textless
        return out, self._token_events(out)

    def finish(self) -> bytes:
        """What is left when the upstream ends: a held usage chunk, the [DONE] event, or an
        unterminated last event, forwarded as is."""
        tail, self._tail = self.held + self._tail, b""
        return tail + self._partial.drain() if self._partial.size else tail

    def closed_whole(self, last: bytes) -> bool:
        """Whether a stream the backend closed may end as a whole one: its `[DONE]` came, or
        its answer is visibly complete without it (some OpenAI-compatible servers omit it): no
        half event left, a finish_reason in its last reads (`last`; the usage chunk held), and
        the usage owed, if any. A stream that is whole but for `[DONE]` gets one from `finish`.
        Asked once, at the end: nothing is looked for a read."""
        if self._tail or last.find(_DONE) >= 0:
            return True
        if self._partial.size:  # half an event, or [DONE] without its blank line
            return self._partial.peek().find(_DONE) >= 0
        if self.usage is None and self._owes_usage():
            return False
        if _FINISHED.search(self.held + last) is None:
            return False
        self._tail = b"data: [DONE]\n\n"
        return True

    def _owes_usage(self) -> bool:
        """Whether a whole stream has its usage chunk: one the client asked for comes after
        every choice's finish_reason."""
        return self._keep_usage

    def textless(self, read: bytes) -> int:
        """The events (choices, `_choices_in`) without text, usage aside, from the first token
        on in a sent `read`: each took a token's place in the count. Asked once, at the end."""
        first = _TOKEN.search(read)
        if first is None:
            return 0
        read = _from_event_of(read, first)
        return sum(
            max(0, self._choices_in(event) - len(_TEXT.findall(event)))
            for event in EVENT_END.split(read)
            if _DATA_LINE.search(event) and event.find(_USAGE_MARK) < 0
        )

    def _choices_in(self, event: bytes) -> int:
        return 1

    def _token_events(self, out: bytes) -> int:
        """Until the first token: the events from the first one with text on count as tokens,
        bar a usage-only one ([DONE] never reaches here: `feed` holds it back). After it, `feed`
        counts every data event but the usage-only ones."""
        first = _TOKEN.search(out)
        if first is None:
            self.texted = _TEXT.search(out) is not None
            return 0
        self._saw_token = self.texted = True
        self._learn_text_head(out, first)
        out = _from_event_of(out, first)
        return _data_events(out, out.count(_DATA)) - self._textless

    def _search_text(self, out: bytes) -> bool:
        found = _TEXT.search(out)
        if found is None:
            return False
        self._learn_text_head(out, found)
        return True

    def _learn_text_head(self, out: bytes, found: re.Match[bytes]) -> None:
        """Remember where the text begins if `found` is in `out`'s first event (until then every
        read is searched)."""
        if out.startswith(_DATA) and after_last_end(out, 0, found.start()) < 0:
            self._text_at = found.end()
            self._text_head = out[: self._text_at]

    def _take_usage(self, out: bytes) -> bytes:
        """`out` (whole events) with each event that mentions usage as `_usage_event` leaves
        it; every other event as it came. Only those events are cut out: a read that holds a
        whole stream (an unpaced backend) is not walked an event at a time."""
        kept: list[bytes] = []
        copied = 0  # where the bytes not yet in `kept` begin
        mark = out.find(_USAGE_MARK)
        while mark >= 0:
            start = max(copied, after_last_end(out, copied, mark))
            end = EVENT_END.search(out, mark)
            if end is None:  # not so: `out` is whole events
                break
            event = self._usage_event(out[start : end.start()], end[0])
            kept.append(out[copied:start])
            if event:
                kept.append(event + end[0])
            copied = end.end()
            mark = out.find(_USAGE_MARK, copied)
        kept.append(out[copied:])
        return b"".join(kept)

    def _usage_event(self, event: bytes, end: bytes) -> bytes:
        """Record the usage; return the event as the client should see it (b"" to drop it or
        to hold it).

        The usage chunk exists because the gateway asked for it: a client that did not ask
        never sees it, malformed or not (an event that is no JSON, or whose `usage` is no
        object), and where it is passed on it is no token."""
        chunk = _data_json(event)
        as_it_came = chunk is _NOT_JSON  # orjson refuses it, so cannot write it again
        if as_it_came:
            chunk = _as_clients_read(event)
            if chunk is _NOT_JSON:
                return event if _CHOICE.search(event) else self._usage_only(event, end, None)
        if not isinstance(chunk, dict) or "usage" not in chunk:
            return event  # `prompt_tokens` said elsewhere (a choice's text)
        usage = chunk["usage"]
        if isinstance(usage, dict):
            self.usage = usage
        if not chunk.get("choices"):
            return self._usage_only(event, end, chunk)
        if usage is None:
            return event
        if self._keep_usage:
            # The usage of a chunk with choices (llama.cpp's last chunk) the client may see only
            # if believed: else it goes without, and a chunk of the bill ends the stream.
            self.unshown = not self._shows(usage)
            if not self.unshown:
                self.passed = True
                return event
        if as_it_came:
            return event  # (a choice's text orjson refuses: with its usage, not without it)
        chunk["usage"] = None
        try:
            content = orjson.dumps(chunk)
        except orjson.JSONEncodeError:  # nested past the 254 levels orjson writes (it reads 1024)
            return b"data: " + json_text(chunk).encode()
        return b"data: " + as_written(content, chunk, event)  # a big integer as it came

    def _usage_only(self, event: bytes, end: bytes, chunk: dict[str, Any] | None) -> bytes:
        if not self._keep_usage:
            return b""
        if _DATA_LINE.search(event) is None:  # a comment that says it is no data event
            return event
        if self._hold or not self._shows(None if chunk is None else chunk["usage"]):
            self.held, self.held_chunk = event + end, chunk  # shown as billed, at the end
            return b""
        self.unshown = False
        self._textless += 1
        return event

    def _shows(self, usage: object) -> bool:
        """Whether the client that asked for usage may see `usage` as it came: believed (or
        not checked)."""
        return self._believed is None or (isinstance(usage, dict) and bool(self._believed(usage)))


class ChoicesForwarder(SSEForwarder):
    """An SSEForwarder for a request of several answers (`n`, a completions batch): an event
    that carries several choices side by side counts one token event for each, as if the backend
    had sent each choice in an event of its own. Only such requests pay the extra count."""

    __slots__ = ("_mark",)

    def __init__(
        self, *, keep_usage: bool, completions: bool, believed: Believed | None = None
    ) -> None:
        super().__init__(keep_usage=keep_usage, believed=believed)
        # A key in each choice and nowhere else in a chunk (a completion's "text" can be a key
        # of its `top_logprobs`, a token named so); a backend without it counts as before.
        self._mark = b'"finish_reason":' if completions else b'"delta":'

    def feed(self, data: bytes) -> tuple[bytes, int]:
        first = not self._saw_token
        out, events = super().feed(data)
        if events and out.count(self._mark) > events:
            if first:  # the events before the first text are not counted
                found = _TOKEN.search(out)
                out_counted = _from_event_of(out, found) if found else b""
            else:
                out_counted = out
            events += _more_choices(out_counted, self._mark)
        return out, events

    def _choices_in(self, event: bytes) -> int:
        return max(1, event.count(self._mark))

    def _owes_usage(self) -> bool:
        """Always (the gateway asks for it): the last reads show one choice's finish_reason,
        not each one's; the usage chunk comes once every choice has finished."""
        return True


def _from_event_of(out: bytes, found: re.Match[bytes]) -> bytes:
    """`out` from the data line of the event `found` is in on."""
    return out[max(0, out.rfind(_DATA, 0, found.start())) :]


def _more_choices(out: bytes, mark: bytes) -> int:
    """The choices past the first in each of `out`'s events."""
    return sum(max(0, event.count(mark) - 1) for event in EVENT_END.split(out))


_NOT_JSON = object()


def _payload(event: bytes) -> bytes:
    """An event's `data:` lines, joined."""
    return b"".join(
        line[len(_DATA) :].strip() for line in event.splitlines() if line.startswith(_DATA)
    )


def _data_json(event: bytes) -> Any:
    """The JSON an event's `data:` lines carry, joined; _NOT_JSON if they are not JSON."""
    try:
        return orjson.loads(_payload(event))
    except orjson.JSONDecodeError:
        return _NOT_JSON


def _as_clients_read(event: bytes) -> Any:
    """An event orjson refuses as a client's JSON reader reads it (a lone surrogate's escape,
    which JavaScript joins with the next event's half); _NOT_JSON if no reader takes it."""
    try:
        return leniently(_payload(event))
    except MalformedAnswer:
        return _NOT_JSON


def _data_events(out: bytes, lines: int) -> int:
    """How many of `out`'s (whole) events carry data, given its count of `data:`: events, not
    lines (an event may have several, and text may say `data:`). Where each `data:` begins an
    event (a blank line before it, in a stream's one kind of line end or the other): that count."""
    if lines < 2:
        return lines if out.startswith(_DATA) or lines == 0 else _slowly(out)
    firsts = out.startswith(_DATA) + out.count(b"\n\ndata:")
    if firsts == lines or firsts + out.count(b"\n\r\ndata:") == lines:
        return lines
    return _slowly(out)


def _slowly(out: bytes) -> int:
    return sum(_DATA_LINE.search(event) is not None for event in EVENT_END.split(out))
