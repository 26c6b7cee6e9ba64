"""Keep a request's lease (a quota reservation, concurrency slots) alive while it runs: renewed
every third of its length by a timer of the event loop, not a task per request."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from proxy.storage.base import StorageError

__all__ = ["Renewal"]


class Renewal:
    """Calls `renew` every `lease_s / 3` seconds until cancelled; a renewal that fails is
    logged as `what` and the next one is tried all the same."""

    __slots__ = ("_every_s", "_handle", "_log", "_renew", "_what")

    def __init__(
        self,
        renew: Callable[[], Awaitable[object]],
        lease_s: float,
        log: logging.Logger,
        what: str,
    ) -> None:
        self._renew = renew
        self._every_s = lease_s / 3
        self._log = log
        self._what = what
        self._handle = asyncio.get_running_loop().call_later(self._every_s, self._due)

    def cancel(self) -> None:
        self._handle.cancel()

    def _due(self) -> None:
        self._handle = asyncio.get_running_loop().call_later(self._every_s, self._due)
        asyncio.ensure_future(self._renew()).add_done_callback(self._done)

    def _done(self, renewal: asyncio.Future[object]) -> None:
        if renewal.cancelled():
            return
        error = renewal.exception()
        if isinstance(error, StorageError):
            self._log.warning("could not renew %s: %s", self._what, error)
        elif error is not None:
            raise error
