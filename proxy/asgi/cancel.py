"""A request's cancel scope: the client leaving or the drain cutting the request stops it at its
next await, except inside `shielded()`, where its holds are being released or settled.

What anyio's CancelScope gave the pipeline, for asyncio alone and at a fraction of the cost
(anyio looks up the running library, the task and its scope stack on every scope opened, four
times a request). Cancellation is delivered only while the task is waiting (from the
connection's `connection_lost` or the disconnect watcher's task, the drain's timer, or a
callback scheduled for the purpose), never while it runs: so it always lands at an await
inside the scope and outside every shield, and a shield that ends with a cancel pending passes
it on at the task's next wait.

A cancel a library lost (Python 3.11's `asyncio.wait_for`, inside redis-py, returns an inner
result that finished as the cancel came, and drops the cancel) is delivered again: while the
scope is still open a moment after a delivery, the task is cancelled once more, as anyio's
scope re-delivers. Else a request whose client had left would go on to call its backend.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

__all__ = ["REDELIVER_S", "RequestScope"]

REDELIVER_S = 0.05
"""How long after a delivery a scope still open is cancelled again (its cancel was lost)."""


class RequestScope:
    """`with RequestScope() as scope:` in the request's task; `scope.cancel()` from anywhere on
    the loop. The CancelledError the scope delivered ends at the scope's end; any other
    cancellation of the task (the server's, a caller's) passes through it untouched."""

    __slots__ = ("_delivered", "_open", "_shields", "_task", "cancel_called")

    def __init__(self) -> None:
        self._task: asyncio.Task[object] | None = None
        self._open = False
        self._shields = 0
        self._delivered = 0  # cancels delivered to the task, each taken back at the end
        self.cancel_called = False

    def __enter__(self) -> RequestScope:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a RequestScope is opened in a task")
        self._task = task
        self._open = True
        if self.cancel_called:
            self._later()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        self._open = False
        if not self._delivered or self._task is None:
            return False
        # Ours were delivered: take them back, and end their CancelledError here unless the
        # task is also being cancelled by someone else.
        for _ in range(self._delivered - 1):
            self._task.uncancel()
        return self._task.uncancel() == 0 and exc_type is asyncio.CancelledError

    def cancel(self) -> None:
        """Stop the scope's work at its next await outside a shield (now, if it waits outside
        one); nothing once the scope has ended."""
        if self.cancel_called:
            return
        self.cancel_called = True
        if self._task is asyncio.current_task():
            self._later()  # it is running: deliver once it waits
        else:
            self._deliver()

    def shielded(self) -> _Shielded:
        """No cancellation from this scope lands inside; one that came meanwhile lands after."""
        return _Shielded(self)

    def _unshield(self) -> None:
        self._shields -= 1
        if self.cancel_called and not self._delivered:
            self._later()

    def _later(self) -> None:
        if self._task is not None:
            self._task.get_loop().call_soon(self._deliver)

    def _deliver(self) -> None:
        if self._open and not self._shields and not self._delivered and self._task is not None:
            self._cancel(self._task)

    def _cancel(self, task: asyncio.Task[object]) -> None:
        self._delivered += 1
        task.cancel()
        task.get_loop().call_later(REDELIVER_S, self._again)

    def _again(self) -> None:
        """Still in the scope a moment after a delivery: cancelled again, unless it is in a
        shield now (it is then looked at again later), as the cancel may have been lost."""
        task = self._task
        if not self._open or task is None or task.done():
            return
        if self._shields:
            task.get_loop().call_later(REDELIVER_S, self._again)
        else:
            self._cancel(task)


class _Shielded:
    """`with scope.shielded():` (a class, not a generator: entered twice a request)."""

    __slots__ = ("_scope",)

    def __init__(self, scope: RequestScope) -> None:
        self._scope = scope

    def __enter__(self) -> None:
        self._scope._shields += 1

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._scope._unshield()
