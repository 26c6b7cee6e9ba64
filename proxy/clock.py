"""Time sources: the monotonic clock for durations, wall time for records; fakeable in tests."""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["Clock", "FakeClock", "SystemClock"]


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back; only differences mean anything."""

    def wall(self) -> float:
        """Seconds since the Unix epoch, for records people read."""


class SystemClock:
    __slots__ = ()

    def monotonic(self) -> float:
        return time.perf_counter()

    def wall(self) -> float:
        return time.time()


class FakeClock:
    """A clock that moves only when told to."""

    __slots__ = ("_mono", "_wall")

    def __init__(self, start_wall: float = 1_800_000_000.0) -> None:
        self._mono = 0.0
        self._wall = start_wall

    def monotonic(self) -> float:
        return self._mono

    def wall(self) -> float:
        return self._wall

    def advance(self, seconds: float) -> None:
        self._mono += seconds
        self._wall += seconds
