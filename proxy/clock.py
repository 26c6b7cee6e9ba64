"""Time sources: the monotonic clock for durations, wall time for records, and timers on it;
fakeable in tests."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Protocol

__all__ = ["Clock", "FakeClock", "SystemClock", "Timer"]


class Timer(Protocol):
    def cancel(self) -> None:
        """The callback will not be called (if it has not been already)."""


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back; only differences mean anything."""

    def wall(self) -> float:
        """Seconds since the Unix epoch, for records people read."""

    def call_later(self, delay_s: float, callback: Callable[[], object]) -> Timer:
        """Call `callback` once, `delay_s` seconds from now on this clock, on the event loop
        it was set from."""


class SystemClock:
    """The clocks are the C functions themselves: a request reads them about 30 times, and a
    method around each would be a Python call every time."""

    __slots__ = ()

    monotonic = staticmethod(time.perf_counter)
    wall = staticmethod(time.time)

    def call_later(self, delay_s: float, callback: Callable[[], object]) -> Timer:
        return asyncio.get_running_loop().call_later(delay_s, callback)


class FakeClock:
    """A clock that moves only when told to; its timers fire as `advance` passes them."""

    __slots__ = ("_mono", "_order", "_timers", "_wall")

    def __init__(self, start_wall: float = 1_800_000_000.0) -> None:
        self._mono = 0.0
        self._wall = start_wall
        self._timers: list[tuple[float, int, _FakeTimer]] = []
        self._order = itertools.count()  # timers due at the same time fire in the order set

    def monotonic(self) -> float:
        return self._mono

    def wall(self) -> float:
        return self._wall

    def call_later(self, delay_s: float, callback: Callable[[], object]) -> Timer:
        timer = _FakeTimer(callback)
        heapq.heappush(self._timers, (self._mono + delay_s, next(self._order), timer))
        return timer

    def advance(self, seconds: float) -> None:
        """Move on by `seconds`, firing each timer due on the way at its time, in order (a
        timer a callback sets fires too if it falls due before the end)."""
        end_mono, end_wall = self._mono + seconds, self._wall + seconds
        while self._timers and self._timers[0][0] <= end_mono:
            due, _, timer = heapq.heappop(self._timers)
            self._wall += due - self._mono
            self._mono = due
            timer.fire()
        self._mono, self._wall = end_mono, end_wall

    def step_wall(self, seconds: float) -> None:
        """Set the wall clock on (or back, below zero) by `seconds` as NTP steps it; the
        monotonic clock and its timers do not move."""
        self._wall += seconds


class _FakeTimer:
    """Fires on the event loop it was set from: a test thread advancing the clock of a gateway
    served in another thread hands the callback to that loop."""

    __slots__ = ("_callback", "_loop")

    def __init__(self, callback: Callable[[], object]) -> None:
        self._callback: Callable[[], object] | None = callback
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None

    def cancel(self) -> None:
        self._callback = None

    def fire(self) -> None:
        callback, self._callback = self._callback, None
        if callback is None:
            return
        loop = self._loop
        if loop is None or _running_loop() is loop:
            callback()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(callback)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
