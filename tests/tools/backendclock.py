"""What a backend did, timed by its own clock, and how long this machine kept threads waiting:
the references `tokenweir bench`'s measurements are judged against on a loaded machine."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["BackendClock", "Timeline", "worst_stall"]

CONTENT = b'"delta":{"content":"'  # a chat stream event carrying generated text


@dataclass
class Timeline:
    """One request as the backend served it: its arrival, then each body write with its time
    and the content events in it (`perf_counter`, the clock the bench reads too)."""

    arrived_s: float
    writes: list[tuple[float, int]] = field(default_factory=list)

    def _content_s(self) -> list[float]:
        return [at_s for at_s, events in self.writes if events]

    @property
    def ttft_s(self) -> float:
        return self._content_s()[0] - self.arrived_s

    @property
    def e2e_s(self) -> float:
        return self.writes[-1][0] - self.arrived_s

    @property
    def span_s(self) -> float:
        """First content write to the last."""
        content_s = self._content_s()
        return content_s[-1] - content_s[0]

    def gaps_s(self) -> list[float]:
        """The gap before each content event after the first; events sharing a write follow
        their first at once, as a reader of that write sees them."""
        content = [(at_s, events) for at_s, events in self.writes if events]
        gaps = [0.0] * (content[0][1] - 1)
        for (before_s, _), (at_s, events) in itertools.pairwise(content):
            gaps += [at_s - before_s] + [0.0] * (events - 1)
        return gaps


@dataclass
class BackendClock:
    """ASGI middleware keeping a `Timeline` of every `/v1/` request the wrapped app serves."""

    app: ASGIApp
    timelines: list[Timeline] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        timeline = Timeline(time.perf_counter())
        self.timelines.append(timeline)

        async def timed(message: Message) -> None:
            if message["type"] == "http.response.body":  # timed before: no reader is earlier
                events = message.get("body", b"").count(CONTENT)
                timeline.writes.append((time.perf_counter(), events))
            await send(message)

        await self.app(scope, receive, timed)


@contextmanager
def worst_stall(interval_s: float = 0.002) -> Iterator[list[float]]:
    """A thread sleeping `interval_s` at a time while the block runs; afterwards the list holds
    its worst oversleep: the longest this machine (CPU and GIL) kept a ready thread waiting,
    which delays a backend's writes and a client's reads just as much. Near 0 when idle."""
    worst = [0.0]
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            began_s = time.perf_counter()
            time.sleep(interval_s)
            worst[0] = max(worst[0], time.perf_counter() - began_s - interval_s)

    thread = threading.Thread(target=probe, name="stall-probe", daemon=True)
    thread.start()
    try:
        yield worst
    finally:
        stop.set()
        thread.join()
