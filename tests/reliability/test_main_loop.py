"""The server `tokenweir serve` runs in one process (proxy/asgi/server.py): its main loop
sleeps while nothing happens, and a signal to stop ends the sleep at once."""

from __future__ import annotations

import asyncio
import signal
from email.utils import parsedate_to_datetime

import pytest
import uvicorn

from proxy.asgi import server as served
from proxy.asgi.server import GatewayServer

pytestmark = pytest.mark.anyio


async def _app(scope: object, receive: object, send: object) -> None:  # never called here
    raise AssertionError("no request is sent")


class _Counted(GatewayServer):
    ticks = 0

    async def on_tick(self, counter: int) -> bool:
        self.ticks += 1
        return await super().on_tick(counter)


async def test_an_idle_main_loop_wakes_once_a_second_and_keeps_the_date_header() -> None:
    """uvicorn's own wakes ten times a second (a wake of an idle process costs CPU)."""
    server = _Counted(uvicorn.Config(_app))
    loop = asyncio.create_task(server.main_loop())
    await asyncio.sleep(2.5)
    ticks = server.ticks
    [date] = [value for name, value in server.server_state.default_headers if name == b"date"]
    server.handle_exit(signal.SIGTERM, None)
    await asyncio.wait_for(loop, 30)
    assert 1 <= ticks <= 4  # about 3: at start, then every second; uvicorn's 25
    assert parsedate_to_datetime(date.decode()).tzinfo is not None


async def test_a_signal_to_stop_ends_the_wait_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a tick of an hour, only the signal's wake can end the loop within the test."""
    monkeypatch.setattr(served, "TICK_S", 3600.0)
    server = _Counted(uvicorn.Config(_app))
    loop = asyncio.create_task(server.main_loop())
    await asyncio.sleep(0.2)
    server.handle_exit(signal.SIGTERM, None)
    await asyncio.wait_for(loop, 30)
    assert server.should_exit
    assert server.ticks == 2  # the first, and the one that saw the signal
