"""When shared storage fails: the tenant's open or closed policy, each decision counted, and
the late effect of a call that timed out undone."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable

from proxy.clock import Clock, SystemClock
from proxy.errors import StorageUnavailable
from proxy.policy.model import Limits
from proxy.storage.base import (
    StorageError,
    StorageTimeout,
    StorageUnreachable,
    StorageUnsent,
)
from proxy.together import cancelled

__all__ = ["StorageFailures", "warned"]

_log = logging.getLogger("tokenweir.storage")


class StorageFailures:
    """Counts each decision (`quota:open`, `rate_limit:closed`, ...) for /readyz and metrics."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.counts: Counter[str] = Counter()
        self.last_error: str | None = None
        self._clock = clock or SystemClock()
        self.last_failure_s: float | None = None  # monotonic; for `storage_unavailable` rules
        self._undoing: set[asyncio.Task[None]] = set()

    def failed_within(self, window_s: float) -> bool:
        """Did shared storage fail in the last `window_s` seconds?"""
        last = self.last_failure_s
        return last is not None and self._clock.monotonic() - last <= window_s

    def decide(self, what: str, limits: Limits, exc: StorageError) -> None:
        """Refuse with 503 if the tenant's policy is `closed`; else log and let the request in."""
        self.last_error = str(exc)
        self.last_failure_s = self._clock.monotonic()
        trouble = _trouble(exc)
        if limits.on_storage_error == "closed":
            self.counts[f"{what}:closed"] += 1
            raise StorageUnavailable(
                f"The {what.replace('_', ' ')} storage {trouble}; try again shortly.",
                retry_after_s=1,
            ) from exc
        self.counts[f"{what}:open"] += 1
        _log.warning("%s storage %s, admitting (on_storage_error: open): %s", what, trouble, exc)

    def undo_later(
        self, exc: StorageError, undo: Callable[[], Awaitable[object]], within_s: float
    ) -> None:
        """A call that timed out may still run once a slow storage catches up, and one whose
        connection was lost may have run before it was: either may have taken what no request
        will give back (a slot, a reservation) until its lease ends. `undo` (safe to repeat) is
        sent once the storage answers again, and once more half a second later for a late call
        that reaches it after the first; after `within_s` the lease has ended anyway. A call
        never sent ran nothing, and one answered with an error took nothing: no undo."""
        if isinstance(exc, StorageTimeout | StorageUnreachable) and not isinstance(
            exc, StorageUnsent
        ):
            self._send_later(undo, within_s, times=2)

    def resend(self, call: Callable[[], Awaitable[object]], within_s: float) -> None:
        """A call storage did not take (a release: safe to repeat), sent again until it takes
        it once; after `within_s` what it would free has freed itself (a lease ended)."""
        self._send_later(call, within_s, times=1)

    def _send_later(
        self, call: Callable[[], Awaitable[object]], within_s: float, *, times: int
    ) -> None:
        task = asyncio.create_task(self._undo(call, within_s, times))
        self._undoing.add(task)
        task.add_done_callback(self._undoing.discard)

    async def _undo(
        self, undo: Callable[[], Awaitable[object]], within_s: float, times: int
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + within_s
        sent, delay_s = 0, 0.1
        while sent < times and loop.time() + delay_s < deadline_s:
            await asyncio.sleep(delay_s)
            try:
                await undo()
            except StorageError:
                delay_s = min(delay_s * 2, 2.0)
                continue
            sent, delay_s = sent + 1, 0.5

    async def aclose(self) -> None:
        await cancelled(list(self._undoing))


async def warned(call: Awaitable[object], log: logging.Logger, message: str, *args: object) -> None:
    """Wait for a storage call already made; if it fails, log `message` % (*args, error) as a
    warning (settling: a lease expires on its own, the use is still in the ledger)."""
    try:
        await call
    except StorageError as exc:
        log.warning(message, *args, exc)


def _trouble(exc: StorageError) -> str:
    """What went wrong, in the client's words: a Redis that answers but refuses (full under
    noeviction, a read-only replica, a failed save) is not an unreachable one."""
    if isinstance(exc, StorageTimeout):
        return "did not answer in time"
    if isinstance(exc, StorageUnreachable):
        return "is unreachable"
    return "refused the operation"
