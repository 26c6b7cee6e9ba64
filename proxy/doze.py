"""A background worker's sleep while it has nothing to do, woken by the first work that comes.

A writer that polls on a timer wakes every interval to find nothing, and each wake of a sleeping
thread or task costs CPU (100-200 µs on a small virtual machine). So after an empty interval it
dozes instead, and the producer's `wake()` ends the doze only when the worker is dozing: a
producer under steady load, whose worker is busy or waiting on its interval, signals nothing.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

__all__ = ["AsyncDoze", "Doze"]


class Doze:
    """For a worker thread: `until(has_work)` returns once `has_work()` or a `wake()` says to."""

    __slots__ = ("_dozing", "_woken")

    def __init__(self) -> None:
        self._woken = threading.Event()
        self._dozing = False

    def until(self, has_work: Callable[[], bool]) -> None:
        self._dozing = True  # before the look: a wake() after it ends the wait
        if not has_work():
            self._woken.wait()
        self._dozing = False
        self._woken.clear()

    def wake(self) -> None:
        if self._dozing:
            self._woken.set()


class AsyncDoze:
    """The same for a task on the event loop that also calls `wake()`."""

    __slots__ = ("_dozing", "_woken")

    def __init__(self) -> None:
        self._woken = asyncio.Event()
        self._dozing = False

    async def until(self, has_work: Callable[[], bool]) -> None:
        if not has_work():
            self._dozing = True
            await self._woken.wait()
            self._dozing = False
        self._woken.clear()

    def wake(self) -> None:
        if self._dozing:
            self._woken.set()
