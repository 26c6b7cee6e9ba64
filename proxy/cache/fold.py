"""A stream's answer, folded in as its chunks pass (`StreamFold`), so storing it costs O(1) per
chunk.

A stream usually repeats one chunk: the same id, model and fields around a new piece of
text. The first such chunk is parsed and becomes a template (the bytes before and after its
text); every later chunk that matches it byte for byte, with a text free of quotes and
backslashes, is kept as that text's bytes without being parsed (OpenAI's `obfuscation`
padding, new in every chunk, is a second hole in the template). Every other chunk (the role
chunk, tool calls, a text with an escape, the finish chunk) is parsed on its own. Reads are
folded about 8 KB at a time (a paced stream comes a token a read), and such a batch, or a read
that holds many events, is cut apart in bulk and halved around the events off the template: a
few calls a batch, not one an event. When the stream ends each kind of text is decoded once;
nothing re-reads the stream. The answer is the one a parse of every chunk would give, byte
for byte, and refused where that one is.
"""

from __future__ import annotations

import re
from operator import itemgetter
from typing import Any, Final

import orjson

from proxy.cache.answer import UNFINISHED, Answer
from proxy.cache.template import Template

__all__ = ["StreamFold", "from_stream"]

_DATA: Final = b"data:"
_DONE: Final = b"[DONE]"
_LF_END: Final = b"\n\n"
_CRLF_END: Final = b"\r\n\r\n"
# Stands in for a template's text to prove the template parses as a text-only chunk.
_PROBE: Final = "tokenweir-probe"
# A backend whose chunks vary (a per-chunk timestamp) is not re-learned forever.
_MAX_TEMPLATES: Final = 4
# Reads wait to be folded until they hold this many bytes (about 35 chunks of a chat stream):
# a batch's events on the template are cut apart together, not in Python calls for each (a
# paced stream comes a token a read), and a batch's own calls are paid once for them all (a
# fifth of the fold at 2 KB a batch). An open stream holds at most this much more.
_BATCH_BYTES: Final = 8192
# Events off the template cut off a read's end before it is halved instead (a stream's last
# read or batch ends with its finish chunk and [DONE], perhaps a usage chunk).
_PEELED: Final = 4
# Errors a malformed chunk may raise while folded; the fold gives up, the relay goes on.
_MALFORMED: Final = (AttributeError, KeyError, IndexError, TypeError, ValueError)
# The texts a chunk's delta may carry (`reasoning`: vLLM >= 0.11's name, OpenRouter's, Ollama's).
_TEXTS: Final = ("content", "reasoning_content", "reasoning", "refusal", "text")
# A delta's fields the answer keeps: a chunk with any other (not null) is not stored, as its
# replay would lack it (audio, a legacy function_call, a vendor's own).
_DELTA_FIELDS: Final = frozenset({*_TEXTS, "role", "tool_calls"})
# A tool call delta's fields merged piece by piece; any other is kept as the backend sent it.
_CALL_FIELDS: Final = frozenset({"index", "id", "type", "function"})
# A byte that only continues a UTF-8 character: a text piece starting with one was cut out of
# the middle of a character.
_CONTINUATION: Final = re.compile(rb"[\x80-\xbf]")
_FIRST_BYTE: Final = itemgetter(0)


def from_stream(operation: str, events: bytes, usage: dict[str, Any]) -> Answer | None:
    """The answer a complete SSE stream carried, merged from its deltas; None if incomplete.

    The whole stream at once, as the gateway folds it chunk by chunk (`StreamFold`).
    """
    fold = StreamFold(len(events))
    fold.feed(events)
    return fold.answer(operation, usage)


def _loads(raw: bytes) -> Any:
    """Every parse the fold makes goes through here (a test counts them)."""
    return orjson.loads(raw)


class StreamFold:
    """Feed it the relayed bytes (whole events) in order; `answer` builds the stored answer.

    Gives up for good (the answer is not stored) on anything today's guards refuse: an event
    that is not JSON, an error event, several choices, data after `[DONE]`, more than `limit`
    bytes. `answer` is None unless the stream ended with `[DONE]` after a finish reason.
    """

    __slots__ = (
        "_done", "_fingerprint", "_finish", "_limit", "_model", "_pending", "_pending_size",
        "_size", "_template", "_templates", "_texts", "_tools", "broken",
    )  # fmt: skip

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._size = 0
        self._done = False
        self.broken = False
        self._model = ""
        self._fingerprint: str | None = None
        self._finish: str | None = None
        # Each text as the escaped JSON string bodies of its pieces, decoded once at the end.
        self._texts: dict[str, list[bytes]] = {}
        self._tools: dict[int, dict[str, Any]] = {}
        self._template: Template | None = None
        self._templates = 0
        self._pending: list[bytes] = []
        self._pending_size = 0

    def feed(self, data: bytes) -> None:
        """Take relayed bytes (one or more whole events): folded about `_BATCH_BYTES` at a
        time, and what is left when `answer` is asked for."""
        self._pending.append(data)
        self._pending_size += len(data)
        if self._pending_size >= _BATCH_BYTES:
            self._fold_pending()

    def _fold_pending(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            self._pending_size = 0
            self._fold(data)

    def _fold(self, data: bytes) -> None:
        """Fold in relayed bytes: one or more whole events."""
        if self.broken:
            return
        self._size += len(data)
        if self._size > self._limit:
            self.broken = True
            return
        template = self._template
        if template is not None and not self._done:
            if not template.take(data):  # the usual read: events on the template, nothing parsed
                self._halves(data, template)
            return
        # An event at a time until one gives the template, then the rest in bulk.
        start, sep = 0, _event_end(data)
        while self._template is None and not self.broken:
            end = data.find(sep, start) + len(sep)
            if end < len(sep) or end >= len(data):  # the last event (or not SSE)
                break
            self._lines(data[start:end])
            start = end
        self._events(data[start:] if start else data)

    def _events(self, data: bytes) -> None:
        """Whole events: those on the template are cut apart in bulk, and a batch with others
        is halved until each of those is alone, so a batch costs a few calls, not one an event
        (the usual batch: only events on the template, one split, nothing parsed)."""
        template = self._template
        if self.broken or template is None or self._done:
            self._lines(data)
        elif not template.take(data):
            self._halves(data, template)

    def _halves(self, data: bytes, template: Template) -> None:
        """Events not all on the template: the few at the end off it (the usual: the finish
        chunk, [DONE]) cut off, the rest taken whole; else each half on its own, down to one
        event. (A read that does not end on the template fails `take` at once, so finding the
        end that does costs a few searches, not a split.)"""
        sep, cut = template.sep, len(data)
        # A read that ends on the template has the events off it inside: halved at once.
        peeled = 0 if data.endswith(template.tail) else _PEELED
        for _ in range(peeled):
            cut = data.rfind(sep, 0, cut - len(sep)) + len(sep)
            if cut < len(sep):  # one event: nothing to cut off
                break
            if data.endswith(template.tail, 0, cut):
                self._events(data[:cut])
                self._lines(data[cut:])
                return
        middle = _event_end_near_middle(data, sep)
        if middle:
            self._events(data[:middle])
            self._events(data[middle:])
        else:
            self._lines(data)

    def _lines(self, data: bytes) -> None:
        if self.broken:
            return
        for line in data.splitlines():
            if line.startswith(_DATA):
                self._payload(line, data)
                if self.broken:
                    return

    def answer(self, operation: str, usage: dict[str, Any]) -> Answer | None:
        """The answer the stream carried, or None if it is incomplete or was refused."""
        self._fold_pending()
        if self.broken or not self._done or self._finish is None or self._finish in UNFINISHED:
            return None
        try:
            texts = {name: _decoded(parts) for name, parts in self._texts.items()}
        except ValueError:  # orjson's JSONDecodeError, or a character cut across events
            return None
        if operation == "text_completion":
            text = texts.get("text", "")
            return Answer(
                operation, self._model, self._finish, usage, None, text, self._fingerprint
            )
        message: dict[str, Any] = {"role": "assistant", "content": None}
        for name in ("content", "reasoning_content", "reasoning", "refusal"):
            if name in texts:
                message[name] = texts[name]
        if self._tools:
            message["tool_calls"] = [self._tools[i] for i in sorted(self._tools)]
        return Answer(operation, self._model, self._finish, usage, message, None, self._fingerprint)

    def _payload(self, line: bytes, data: bytes) -> None:
        payload = line[len(_DATA) :].strip()
        if self._done:  # data after [DONE]: not a stream that ended
            self.broken = True
            return
        if payload == _DONE:
            self._done = True
            return
        template = self._template
        if template is not None:
            text = template.text(payload)
            if text is not None:
                template.parts.append(text)
                return
        try:
            chunk = _loads(payload)
            if not isinstance(chunk, dict):
                self.broken = True
                return
            piece = _text_only(chunk)
            if piece is not None:
                self._add_text(chunk, *piece)
                self._learn(line, payload, data, *piece)
            elif "error" in chunk or not self._add(chunk):
                self.broken = True
        except _MALFORMED:
            self.broken = True

    def _add_text(self, chunk: dict[str, Any], name: str, piece: str) -> None:
        self._texts.setdefault(name, []).append(_escaped(piece))
        self._model = self._model or chunk.get("model") or ""

    def _add(self, chunk: dict[str, Any]) -> bool:
        """Fold in any other chunk; False if it is not a one-choice answer's chunk."""
        self._model = chunk.get("model") or self._model
        self._fingerprint = chunk.get("system_fingerprint") or self._fingerprint
        choices = chunk.get("choices") or []
        if len(choices) > 1 or any(c.get("index", 0) != 0 for c in choices):
            return False
        for choice in choices:
            self._finish = choice.get("finish_reason") or self._finish
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                delta = {"text": choice.get("text")}
            elif any(v is not None for k, v in delta.items() if k not in _DELTA_FIELDS):
                return False
            for name in _TEXTS:
                piece = delta.get(name)
                if isinstance(piece, str):
                    self._texts.setdefault(name, []).append(_escaped(piece))
                elif piece is not None:  # a list of parts (Mistral's): no replay would carry it
                    return False
            if not all(map(self._add_tool_call, delta.get("tool_calls") or ())):
                return False
        return True

    def _add_tool_call(self, call: dict[str, Any]) -> bool:
        """Merge a call's delta in; False for one no rule says how to join: a call that is not
        a function's (a custom tool's input in pieces), a field of the backend's own sent twice."""
        kind = call.get("type")
        if kind and kind != "function":  # (a continuation may say "" or null)
            return False
        index = call.get("index")
        merged = self._tools.setdefault(
            self._unindexed(call.get("id")) if index is None else int(index),
            {"id": "", "type": "function", "function": {}},
        )
        merged["id"] = call.get("id") or merged["id"]
        function = call.get("function") or {}
        target = merged["function"]
        if function.get("name"):
            target["name"] = function["name"]
        target["arguments"] = target.get("arguments", "") + (function.get("arguments") or "")
        for name, value in call.items():  # a backend's own, kept for the next request
            if name not in _CALL_FIELDS and value is not None:  # (Google's thought_signature)
                if name in merged:
                    return False
                merged[name] = value
        return True

    def _unindexed(self, call_id: object) -> int:
        """A call delta without its index (Google's OpenAI-compatible endpoint sends each call
        whole that way): a new id is the next call, anything else goes on with the last one."""
        last = max(self._tools, default=-1)
        if last < 0 or (call_id and call_id != self._tools[last]["id"]):
            return last + 1
        return last

    def _learn(self, line: bytes, payload: bytes, data: bytes, name: str, piece: str) -> None:
        """Make this text-only chunk the template, if its text can be cut out of it exactly."""
        if self._templates >= _MAX_TEMPLATES:
            return
        raw = piece.encode()
        marker = b'"' + name.encode() + b'":"' + raw + b'"'
        if not raw or b'"' in raw or b"\\" in raw:
            return
        if payload.count(marker) != 1 or not line.endswith(payload):  # escaped, found twice
            return
        self._templates += 1
        start = payload.index(marker) + len(marker) - len(raw) - 1
        prefix, suffix = payload[:start], payload[start + len(raw) :]
        template = Template(
            self._texts[name], prefix, suffix, line[: -len(payload)], _event_end(data)
        )
        # Proof: the same bytes around another text are a text-only chunk of that text.
        try:
            probe = _loads(template.probe(_PROBE.encode()))
        except orjson.JSONDecodeError:
            return
        if isinstance(probe, dict) and _text_only(probe) == (name, _PROBE):
            self._template = template


def _event_end(data: bytes) -> bytes:
    """How the events of `data` end: as its last one does (CRLF lines or LF). Only where the
    fold cuts depends on it: a cut the bytes do not have leaves them to be folded line by line."""
    return _CRLF_END if data.endswith(_CRLF_END) else _LF_END


def _event_end_near_middle(data: bytes, sep: bytes) -> int:
    """Where an event of `data` (ending in `sep`) ends nearest after (else before) its middle;
    0 if it is one."""
    half = len(data) // 2
    straddles = len(sep) - 1  # an event's end across the middle is found too
    found = data.find(sep, max(0, half - straddles))
    if found < 0 or found + len(sep) >= len(data):
        found = data.rfind(sep, 0, half + straddles)
    return 0 if found < 0 else found + len(sep)


def _text_only(chunk: dict[str, Any]) -> tuple[str, str] | None:
    """(name, piece) if the chunk only carries text for choice 0, else None."""
    choices = chunk.get("choices")
    if not choices or len(choices) != 1:
        return None
    choice = choices[0]
    delta = choice.get("delta")
    if choice.get("finish_reason") is not None or choice.get("index", 0) != 0:
        return None
    if delta is None:  # a text completion's chunk
        piece, name = choice.get("text"), "text"
    elif len(delta) == 1 and "content" in delta:
        piece, name = delta["content"], "content"
    else:
        return None
    return (name, piece) if isinstance(piece, str) else None


def _escaped(piece: str) -> bytes:
    return orjson.dumps(piece)[1:-1]


def _decoded(parts: list[bytes]) -> str:
    """The text of its pieces, refused (as orjson refuses) where a piece is not UTF-8 on its
    own: a character cut across two events reads as one only once they are joined, which no
    parse of each event does, nor a client (a replay would not send what was relayed)."""
    joined = b"".join(parts)
    text: str = _loads(b'"' + joined + b'"')
    if not joined.isascii():
        # Joined, the bytes are UTF-8: a piece is too unless it starts inside a character.
        firsts = bytes(map(_FIRST_BYTE, filter(None, parts)))
        if _CONTINUATION.search(firsts) is not None:
            raise ValueError("a character cut across events")
    return text
