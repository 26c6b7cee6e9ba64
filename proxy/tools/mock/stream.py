"""The mock backend's streaming hot path: one shared ticker paces every stream's SSE tokens.

Chunks are pre-encoded per stream (a byte prefix and suffix around each token's JSON string), and
a stream that wakes late sends every token already due in one write instead of drifting.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import itertools
from dataclasses import dataclass
from typing import Any, Final, Protocol

import orjson
from starlette.types import Send

from proxy.clock import Clock
from proxy.tools.mock.text import TokenSource

__all__ = [
    "ChoicesFormat",
    "Outcome",
    "Schedule",
    "SseFormat",
    "StreamFormat",
    "StreamRun",
    "Ticker",
    "tail_events",
]

_SLOT: Final = "\x00token\x00"
_SLOT_JSON: Final = orjson.dumps(_SLOT)
_DONE_EVENT: Final = b"data: [DONE]\n\n"


class Ticker:
    """Wakes waiting streams when their next token is due, polling every `tick_s` while any wait.

    One timer for all streams keeps the loop's timer heap small, and the tick bounds how often a
    stream can write: at high rates several tokens share one write instead of one write each.
    """

    __slots__ = ("_clock", "_heap", "_seq", "_task", "_tick_s")

    def __init__(self, clock: Clock, tick_s: float = 0.001) -> None:
        self._clock = clock
        self._tick_s = tick_s
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._task: asyncio.Task[None] | None = None

    def wake_at(self, due_s: float, waiter: asyncio.Future[None]) -> None:
        """Resolve `waiter` on the first tick at or after `due_s` (never before)."""
        heapq.heappush(self._heap, (due_s, next(self._seq), waiter))
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        heap = self._heap
        try:
            while heap:
                now = self._clock.monotonic()
                while heap and heap[0][0] <= now:
                    waiter = heapq.heappop(heap)[2]
                    if not waiter.done():
                        waiter.set_result(None)
                await asyncio.sleep(self._tick_s)
        finally:
            self._task = None


@dataclass(frozen=True, slots=True)
class Schedule:
    """Token `i` is due at `first_due_s + i * interval_s`; an interval of 0 means unpaced."""

    first_due_s: float
    interval_s: float
    n_tokens: int

    def due_s(self, i: int) -> float:
        return self.first_due_s + i * self.interval_s

    def due_count(self, now_s: float) -> int:
        """How many tokens are due by `now_s`."""
        if now_s < self.first_due_s:
            return 0
        if self.interval_s <= 0:
            return self.n_tokens
        return min(self.n_tokens, int((now_s - self.first_due_s) / self.interval_s) + 1)


def _split(chunk: dict[str, Any]) -> tuple[bytes, bytes]:
    """Encode `chunk` (holding the slot marker once) as an SSE event, cut around the marker."""
    prefix, suffix = orjson.dumps(chunk).split(_SLOT_JSON)
    return b"data: " + prefix, suffix + b"\n\n"


def _event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


class StreamFormat(Protocol):
    """Encodes one stream's events: tokens `start` to `stop` (and its ending, `tail`, when
    `last`)."""

    def encode(self, tokens: TokenSource, start: int, stop: int, last: bool) -> bytes: ...

    @property
    def tail(self) -> bytes:
        """The stream's last events (a Responses stream's last carries the whole response)."""
        ...


@dataclass(frozen=True, slots=True)
class SseFormat:
    """One stream's pre-encoded bytes: event = prefix + token JSON + suffix (last_suffix at end).

    `head` goes before the first token (chat's role event), `tail` after the last (usage, [DONE]).
    """

    prefix: bytes
    suffix: bytes
    last_suffix: bytes
    head: bytes
    tail: bytes

    @classmethod
    def chat(
        cls, base: dict[str, Any], finish_reason: str, usage: dict[str, int] | None, index: int = 0
    ) -> SseFormat:
        """`base` holds id, object, created and model; `usage` is set when include_usage is;
        `index` is the choice's."""
        extra: dict[str, Any] = {} if usage is None else {"usage": None}

        def chunk(delta: dict[str, str], finish: str | None) -> dict[str, Any]:
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**base, "choices": [choice], **extra}

        prefix, suffix = _split(chunk({"content": _SLOT}, None))
        _, last_suffix = _split(chunk({"content": _SLOT}, finish_reason))
        head = _event(chunk({"role": "assistant", "content": ""}, None))
        return cls(prefix, suffix, last_suffix, head, tail_events(base, usage))

    @classmethod
    def completion(
        cls, base: dict[str, Any], finish_reason: str, usage: dict[str, int] | None, index: int = 0
    ) -> SseFormat:
        extra: dict[str, Any] = {} if usage is None else {"usage": None}

        def chunk(finish: str | None) -> dict[str, Any]:
            choice = {"text": _SLOT, "index": index, "logprobs": None, "finish_reason": finish}
            return {**base, "choices": [choice], **extra}

        prefix, suffix = _split(chunk(None))
        _, last_suffix = _split(chunk(finish_reason))
        return cls(prefix, suffix, last_suffix, b"", tail_events(base, usage))

    def encode(self, tokens: TokenSource, start: int, stop: int, last: bool) -> bytes:
        token = tokens.json
        parts = [self.head] if start == 0 else []
        for i in range(start, stop - 1 if last else stop):
            parts += (self.prefix, token(i), self.suffix)
        if last:
            parts += (self.prefix, token(stop - 1), self.last_suffix, self.tail)
        return b"".join(parts)


@dataclass(frozen=True, slots=True)
class ChoicesFormat:
    """Several choices streamed side by side, as vLLM and OpenAI stream `n` > 1: every choice's
    `head` (its role event), then each step's token of every choice in turn, an event each with
    the choice's own `index` (its finish_reason on its last token), then one `tail` (usage,
    [DONE]) for all."""

    head: bytes
    choices: tuple[StreamFormat, ...]  # each without a head or tail of its own
    tail: bytes

    def encode(self, tokens: TokenSource, start: int, stop: int, last: bool) -> bytes:
        parts = [self.head] if start == 0 else []
        for i in range(start, stop):
            ends = last and i == stop - 1
            parts += [choice.encode(tokens, i, i + 1, ends) for choice in self.choices]
        if last:
            parts.append(self.tail)
        return b"".join(parts)


def tail_events(base: dict[str, Any], usage: dict[str, int] | None) -> bytes:
    """A stream's last events: its usage (when asked for) and [DONE]."""
    if usage is None:
        return _DONE_EVENT
    return _event({**base, "choices": [], "usage": usage}) + _DONE_EVENT


class Outcome(enum.Enum):
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    ABORTED = "aborted"


class StreamRun:
    """Sends one stream's tokens on schedule until done, the client leaves, or a knob aborts it.

    `sent` counts tokens written so far; `on_disconnect` is a done-callback for the task that
    waits on `receive()`, so a departing client wakes the stream at once.
    """

    __slots__ = (
        "_clock",
        "_fmt",
        "_limit",
        "_schedule",
        "_send",
        "_ticker",
        "_tokens",
        "_waiter",
        "disconnected",
        "sent",
    )

    def __init__(
        self,
        *,
        send: Send,
        fmt: StreamFormat,
        tokens: TokenSource,
        schedule: Schedule,
        ticker: Ticker,
        clock: Clock,
        fail_after_tokens: int | None = None,
    ) -> None:
        self._send = send
        self._fmt = fmt
        self._tokens = tokens
        self._schedule = schedule
        self._ticker = ticker
        self._clock = clock
        n_tokens = schedule.n_tokens
        self._limit = n_tokens if fail_after_tokens is None else min(fail_after_tokens, n_tokens)
        self._waiter: asyncio.Future[None] | None = None
        self.disconnected = False
        self.sent = 0

    def on_disconnect(self, watcher: asyncio.Future[Any]) -> None:
        if watcher.cancelled():
            return
        self.disconnected = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def run(self) -> Outcome:
        schedule, limit = self._schedule, self._limit
        while self.sent < limit:
            await self._until(schedule.due_s(self.sent))
            if self.disconnected:
                return Outcome.CANCELLED
            # The token at `sent` is due (we waited for it), so always send at least that one.
            upto = max(self.sent + 1, min(limit, schedule.due_count(self._clock.monotonic())))
            last = upto == schedule.n_tokens
            body = self._encode(self.sent, upto, last)
            await self._send({"type": "http.response.body", "body": body, "more_body": not last})
            self.sent = upto
        return Outcome.COMPLETED if limit == schedule.n_tokens else Outcome.ABORTED

    async def _until(self, due_s: float) -> None:
        if self.disconnected or self._clock.monotonic() >= due_s:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiter = waiter
        self._ticker.wake_at(due_s, waiter)
        try:
            await waiter
        finally:
            self._waiter = None

    def _encode(self, start: int, stop: int, last: bool) -> bytes:
        return self._fmt.encode(self._tokens, start, stop, last)
