"""Graceful shutdown: on SIGTERM, requests in flight may finish within the drain timeout; then
each is ended cleanly (an error event on a stream, 503 before one) so it is still settled."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType

from proxy.asgi.cancel import RequestScope

__all__ = ["Drain"]

_log = logging.getLogger("tokenweir")
_SIGNALS = (signal.SIGTERM, signal.SIGINT)

_Handler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None


class Drain:
    """Tracks each request's cancel scope; `begin()` starts the drain clock, which cuts them all.

    The server (uvicorn) stops accepting on the same signal and waits for requests to end; its
    own graceful-shutdown timeout must be longer than `timeout_s`, so the gateway ends them
    first and every cut request is billed and released before the ledger is flushed."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._active: set[RequestScope] = set()
        self._cut: set[RequestScope] = set()
        self._previous: dict[int, _Handler] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.draining = False
        self.expired = False

    @property
    def in_flight(self) -> int:
        return len(self._active)

    def install(self) -> None:
        """Chain onto the server's SIGTERM/SIGINT handlers (only possible on the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._loop = asyncio.get_running_loop()
        for sig in _SIGNALS:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, previous)
        self._previous.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def begin(self) -> None:
        """Start draining: the requests still in flight after `timeout_s` are cut."""
        if self.draining:
            return
        self.draining = True
        _log.info(
            "draining: %d requests in flight may finish within %.1f s",
            len(self._active),
            self._timeout_s,
        )
        self._timer = asyncio.get_running_loop().call_later(self._timeout_s, self._expire)

    def track(self, scope: RequestScope) -> _Tracked:
        """`with drain.track(scope):` lets the drain cut `scope` when its time is up."""
        return _Tracked(self, scope)

    def _enter(self, scope: RequestScope) -> None:
        if self.expired:
            self._cut_one(scope)
        self._active.add(scope)

    def _leave(self, scope: RequestScope) -> None:
        self._active.discard(scope)

    def was_cut(self, scope: RequestScope) -> bool:
        """Did the drain end this scope's request (rather than the client or the request)?"""
        if scope in self._cut:
            self._cut.discard(scope)
            return True
        return False

    def _expire(self) -> None:
        self._timer = None
        self.expired = True
        if self._active:
            _log.warning("drain timeout: ending %d requests still in flight", len(self._active))
        for scope in list(self._active):
            self._cut_one(scope)

    def _cut_one(self, scope: RequestScope) -> None:
        self._cut.add(scope)
        scope.cancel()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.begin)
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            # Nobody else handles it (the app runs without uvicorn's handlers): act as default.
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)


class _Tracked:
    """What `Drain.track` returns (a class, not a generator: entered on every request)."""

    __slots__ = ("_drain", "_scope")

    def __init__(self, drain: Drain, scope: RequestScope) -> None:
        self._drain, self._scope = drain, scope

    def __enter__(self) -> None:
        self._drain._enter(self._scope)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._drain._leave(self._scope)
