"""The Responses and Messages APIs' named-event streams, pre-encoded (agents.py fills them): a
text answer's (EventFormat) and a tool-calling answer's (CallEventFormat), both StreamFormats.

A token's event is a byte prefix, the token as a JSON string and a suffix, then (on a numbered
stream, as the Responses API's are) its sequence number and the event's close.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import orjson

from proxy.tools.mock.logprobs import Logprobs
from proxy.tools.mock.text import TokenSource
from proxy.tools.mock.toolplan import ToolPlan

__all__ = ["LOGPROBS_SLOT", "SLOT", "CallEventFormat", "EventFormat", "event", "split_delta"]

SLOT: Final = "\x00token\x00"  # stands for a token in a pre-encoded event
LOGPROBS_SLOT: Final = "\x00logprobs\x00"  # stands for a token's logprobs in a delta event
_SLOT_JSON: Final = orjson.dumps(SLOT)
_LOGPROBS_JSON: Final = orjson.dumps(LOGPROBS_SLOT)
_NUMBER: Final = -777_777_777  # stands for a sequence number in a pre-encoded event
_NUMBER_JSON: Final = str(_NUMBER).encode()


def event(data: dict[str, Any]) -> bytes:
    kind: str = data["type"]
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def split_delta(delta: dict[str, Any], *, numbered: bool) -> tuple[bytes, bytes, bytes]:
    """A delta event holding SLOT once, cut around it: prefix, suffix and (when numbered) the
    close after its sequence number."""
    if not numbered:
        prefix, suffix = event(delta).split(_SLOT_JSON)
        return prefix, suffix, b""
    prefix, rest = event({**delta, "sequence_number": _NUMBER}).split(_SLOT_JSON)
    suffix, close = rest.split(_NUMBER_JSON)
    return prefix, suffix, close


@dataclass(frozen=True, slots=True)
class EventFormat:
    """A text answer's stream: each token's event is prefix + token + suffix (and, when
    numbered, its sequence number + close); with `scores`, the suffix is cut where the token's
    logprobs go (LOGPROBS_SLOT)."""

    head: bytes
    prefix: bytes
    suffix: bytes
    numbered_from: int | None
    close: bytes
    tail: bytes
    scores: Logprobs | None = None

    def encode(self, tokens: TokenSource, start: int, stop: int, last: bool) -> bytes:
        parts = [self.head] if start == 0 else []
        first, scores = self.numbered_from, self.scores
        middle, suffix = self.suffix.split(_LOGPROBS_JSON) if scores else (self.suffix, b"")
        for i in range(start, stop):
            parts += (self.prefix, tokens.json(i), middle)
            if scores is not None:
                parts += (orjson.dumps(scores.chat(i, i + 1)["content"]), suffix)
            if first is not None:
                parts += (b"%d" % (first + i), self.close)
        if last:
            parts.append(self.tail)
        return b"".join(parts)


CallEvents = tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]]]
"""One call's events: those opening it, its delta (holding SLOT), those closing it."""


@dataclass(frozen=True, slots=True)
class CallEventFormat:
    """A tool-calling answer's stream: token i is piece i of the calls' arguments, each call's
    pieces framed by its opening and closing events."""

    head: bytes
    openings: tuple[bytes, ...]  # per call
    deltas: tuple[tuple[bytes, bytes], ...]  # per call: its delta's prefix and suffix
    close: bytes
    numbers: tuple[int, ...] | None  # per call: token i's delta is numbered numbers[call] + i
    closings: tuple[bytes, ...]  # per call
    ends: tuple[int, ...]  # per call: the token that ends it
    pieces: tuple[tuple[int, bytes], ...]  # (call index, the piece as a JSON string)
    tail: bytes

    @classmethod
    def build(
        cls,
        plan: ToolPlan,
        n: int,
        started: list[dict[str, Any]],
        calls: list[CallEvents],
        ended: list[dict[str, Any]],
        *,
        numbered: bool,
    ) -> CallEventFormat:
        """The stream of `plan`'s first `n` pieces, a call for each begun one in `calls`."""
        count = 0

        def encoded(events: list[dict[str, Any]]) -> bytes:
            nonlocal count
            if numbered:
                events = [{**e, "sequence_number": count + i} for i, e in enumerate(events)]
                count += len(events)
            return b"".join(map(event, events))

        head = encoded(started)
        openings, deltas, closings, numbers, ends = [], [], [], [], []
        first, close = 0, b""
        for index, (opening, delta, closing) in enumerate(calls):
            taken = sum(1 for at, _ in plan.pieces[:n] if at == index)
            openings.append(encoded(opening))
            numbers.append(count - first)
            count += taken
            prefix, suffix, close = split_delta(delta, numbered=numbered)
            deltas.append((prefix, suffix))
            closings.append(encoded(closing))
            first += taken
            ends.append(first - 1)
        pieces = tuple((index, orjson.dumps(piece)) for index, piece in plan.pieces[:n])
        return cls(
            head, tuple(openings), tuple(deltas), close, tuple(numbers) if numbered else None,
            tuple(closings), tuple(ends), pieces, encoded(ended),
        )  # fmt: skip

    def encode(self, tokens: TokenSource, start: int, stop: int, last: bool) -> bytes:
        parts = [self.head] if start == 0 else []
        numbers = self.numbers
        for i in range(start, stop):
            index, piece = self.pieces[i]
            if i == 0 or self.pieces[i - 1][0] != index:
                parts.append(self.openings[index])
            prefix, suffix = self.deltas[index]
            parts += (prefix, piece, suffix)
            if numbers is not None:
                parts += (b"%d" % (numbers[index] + i), self.close)
            if i == self.ends[index]:
                parts.append(self.closings[index])
        if last:
            parts.append(self.tail)
        return b"".join(parts)
