"""When a wait for a backend's answer times out: an idle limit per read (`read_timeout`) and, if
set, one limit on the wait for the answer's first byte (`first_byte_timeout`)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

import httpx

__all__ = ["FirstByteTimeout", "ReadDeadline"]


class FirstByteTimeout(httpx.ReadTimeout):
    """The backend sent no byte of its answer within the first-byte timeout."""


class ReadDeadline:
    """One exchange's read deadline. Before the first byte of the answer's body (or its end, for
    an empty body) every wait ends at `first_byte_s` after the exchange began; after it, each wait
    may last `idle_s`. Headers alone do not count: a streaming backend sends them at once and
    only then works on its first token. One timer serves many waits, re-arming itself while
    data keeps coming; `expired(first_byte)` is called when a deadline passes."""

    __slots__ = ("_deadline_s", "_expired", "_first_byte_at_s", "_idle_s", "_loop", "_timer",
                 "_timer_at_s")  # fmt: skip

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        idle_s: float | None,
        first_byte_s: float | None,
        expired: Callable[[bool], None],
    ) -> None:
        self._loop = loop
        self._idle_s = idle_s
        self._first_byte_at_s = None if first_byte_s is None else loop.time() + first_byte_s
        self._expired = expired
        self._deadline_s = math.inf
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at_s = math.inf

    def waiting(self) -> None:
        """A wait for the backend begins now."""
        first_byte_at_s = self._first_byte_at_s
        if first_byte_at_s is not None:
            self._deadline_s = first_byte_at_s
        elif self._idle_s is not None:
            self._deadline_s = self._loop.time() + self._idle_s
        else:
            self._deadline_s = math.inf
            return
        if self._deadline_s < self._timer_at_s:  # none armed, or armed for a later deadline
            self._arm()

    def answered(self) -> None:
        """The first byte of the answer arrived: from now on only the idle limit applies."""
        self._first_byte_at_s = None

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at_s = math.inf

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
        self._expired(self._first_byte_at_s is not None)
