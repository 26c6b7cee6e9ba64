"""The server `tokenweir serve` runs in one process: uvicorn's, with a main loop that sleeps.

uvicorn's main loop wakes ten times a second to see whether a signal asked it to stop (and,
every tenth time, to renew the Date header). On a small virtual machine a wake of an idle
process costs 100-200 µs of CPU, so that alone is 1-2 ms a second of an idle gateway's CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import FrameType

import uvicorn

__all__ = ["GatewayServer"]

# How often the main loop wakes with nothing to do: the Date header is renewed as often.
TICK_S = 1.0


class GatewayServer(uvicorn.Server):
    """uvicorn's Server, whose main loop waits for the signal to stop, or at most `TICK_S`
    (the Date header is renewed each time, as uvicorn renews it each second), instead of
    polling ten times a second. A signal to stop ends the wait at once."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    async def main_loop(self) -> None:
        self._loop = asyncio.get_running_loop()
        stop = self._stop = asyncio.Event()
        tick = 0
        while not await self.on_tick(tick):  # a tick that is a multiple of 10 renews the Date
            tick += 10
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TICK_S):
                    await stop.wait()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(stop.set)  # a signal handler may run amid the loop's work
