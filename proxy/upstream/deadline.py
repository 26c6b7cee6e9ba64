"""When a wait for a backend's answer times out: an idle limit per read (`read_timeout`), one limit
on the wait for the answer's first byte (`first_byte_timeout`), one on the whole exchange
(`total_timeout`), on the transport's exchanges (ReadDeadline); and on a stream's content
(ContentDeadline)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Literal

import httpx

__all__ = [
    "ContentDeadline",
    "Expiry",
    "FirstByteTimeout",
    "ReadDeadline",
    "TotalTimeout",
]

Expiry = Literal["idle", "first_byte", "total"]


class FirstByteTimeout(httpx.ReadTimeout):
    """The backend sent no byte of its answer within the first-byte timeout."""


class TotalTimeout(httpx.ReadTimeout):
    """The backend's answer did not end within the total timeout."""


class ReadDeadline:
    """One exchange's deadlines. The total deadline is fixed when the exchange begins, the
    first-byte one when the request is sent; both pass whatever the backend sends meanwhile (a
    head trickled a byte at a time, endless header bytes). The first-byte one ends when the
    first byte of the answer's body (or its end, for an empty body) arrives: headers alone do
    not count, as a streaming backend sends them at once and only then works on its first token.
    After it, each wait may last `idle_s`; one timer serves many waits, re-arming itself while
    data keeps coming. `expired(kind)` is called when a deadline passes."""

    __slots__ = ("_answered", "_deadline_s", "_expired", "_first_byte", "_first_byte_s",
                 "_idle_s", "_loop", "_timer", "_timer_at_s", "_total")  # fmt: skip

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        idle_s: float | None,
        first_byte_s: float | None,
        expired: Callable[[Expiry], None],
        total_s: float | None = None,
    ) -> None:
        self._loop = loop
        self._idle_s = idle_s
        self._expired = expired
        self._first_byte_s = first_byte_s
        self._first_byte: asyncio.TimerHandle | None = None
        self._answered = first_byte_s is None
        self._total = None if total_s is None else self._after(total_s, "total")
        self._deadline_s = math.inf
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at_s = math.inf

    def sent(self) -> None:
        """The request is sent: the wait for the first byte begins."""
        if not self._answered and self._first_byte is None and self._first_byte_s is not None:
            self._first_byte = self._after(self._first_byte_s, "first_byte")

    def waiting(self) -> None:
        """A wait for the backend begins now."""
        if not self._answered or self._idle_s is None:
            self._deadline_s = math.inf  # the first-byte deadline, if any, bounds this wait
            return
        self._deadline_s = self._loop.time() + self._idle_s
        if self._deadline_s < self._timer_at_s:  # none armed, or armed for a later deadline
            self._arm()

    def answered(self) -> None:
        """The first byte of the answer arrived: only the idle and total limits apply from now."""
        self._answered = True
        if self._first_byte is not None:
            self._first_byte.cancel()
            self._first_byte = None

    def cancel(self) -> None:
        """The exchange is over: no deadline passes any more. The callback is dropped too, so
        that the exchange (whose method it is) is freed by its reference count, not the
        garbage collector."""
        self._expired = _never
        self.answered()
        if self._total is not None:
            self._total.cancel()
            self._total = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at_s = math.inf

    def _after(self, delay_s: float, kind: Expiry) -> asyncio.TimerHandle:
        return self._loop.call_later(delay_s, self._expired, kind)

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at_s = self._deadline_s
        self._timer = self._loop.call_at(self._deadline_s, self._on_timer)

    def _on_timer(self) -> None:
        fired_at_s, self._timer, self._timer_at_s = self._timer_at_s, None, math.inf
        if self._deadline_s == math.inf:
            return
        if self._deadline_s > fired_at_s:  # a wait began since: the deadline moved on
            self._arm()
            return
        self._expired("idle")


def _never(kind: Expiry) -> None:
    """What a cancelled deadline calls, should a wait arm its timer again: nothing."""


class ContentDeadline:
    """A stream's deadline for content: its first `data:` event within `first_s` of the request,
    each next one within `idle_s` of the last. SSE comments and blank lines keep a socket busy
    (so the read deadline never passes) but do not count here. Times are the caller's clock."""

    __slots__ = ("_at_s", "_idle_s")

    def __init__(self, sent_s: float, first_s: float | None, idle_s: float | None) -> None:
        self._at_s = math.inf if first_s is None else sent_s + first_s
        self._idle_s = math.inf if idle_s is None else idle_s

    def content(self, now_s: float) -> None:
        self._at_s = now_s + self._idle_s

    def passed(self, now_s: float) -> bool:
        return now_s > self._at_s
