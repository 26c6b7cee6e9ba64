"""A request's leases (a quota reservation, concurrency slots): their ids, and their renewal
while it runs, every third of their length, by a timer on the injected clock (not a task each),
each renewal until a lease's length after now on that clock."""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from proxy.clock import Clock
from proxy.storage.base import StorageError

__all__ = ["Lease", "LeaseIds", "Renewal"]


class LeaseIds:
    """Ids no other lease has, on this replica or another: a random prefix per maker, then a
    count (os.urandom per lease is a system call; an id needs to be unique, not secret)."""

    __slots__ = ("_count", "_prefix")

    def __init__(self) -> None:
        self._prefix = secrets.token_hex(8)
        self._count = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._count):x}"


class Renewal:
    """Calls `renew` every `lease_s / 3` seconds on `clock` until cancelled; a renewal that
    fails is logged as `what` and the next one is tried all the same."""

    __slots__ = ("_clock", "_every_s", "_log", "_renew", "_timer", "_what")

    def __init__(
        self,
        renew: Callable[[], Awaitable[object]],
        lease_s: float,
        clock: Clock,
        log: logging.Logger,
        what: str,
    ) -> None:
        self._renew = renew
        self._every_s = lease_s / 3
        self._clock = clock
        self._log = log
        self._what = what
        self._timer = clock.call_later(self._every_s, self._due)

    def cancel(self) -> None:
        self._timer.cancel()

    def _due(self) -> None:
        self._timer = self._clock.call_later(self._every_s, self._due)
        asyncio.ensure_future(self._renew()).add_done_callback(self._done)

    def _done(self, renewal: asyncio.Future[object]) -> None:
        if renewal.cancelled():
            return
        error = renewal.exception()
        if isinstance(error, StorageError):
            self._log.warning("could not renew %s: %s", self._what, error)
        elif error is not None:
            raise error


@dataclass(slots=True)
class Lease:
    """A lease a request holds on storage until it is settled: its id, the scope of its keys (the
    owner's hash tag), and its length. `keep` renews it while the request runs, `end` stops."""

    scope: str
    lease_id: str
    lease_s: float
    _renewal: Renewal | None = field(default=None, init=False, repr=False)

    def keep(
        self,
        renew: Callable[[float], Awaitable[object]],
        clock: Clock,
        log: logging.Logger,
        what: str,
    ) -> None:
        """Call `renew(until)` every third of the lease's length, `until` being the lease's
        length after now on `clock`; a failed renewal is logged as `what`."""

        def again() -> Awaitable[object]:
            return renew(clock.wall() + self.lease_s)

        self._renewal = Renewal(again, self.lease_s, clock, log, what)

    def end(self) -> None:
        """Stop renewing (settling gives the lease back)."""
        if self._renewal is not None:
            self._renewal.cancel()
            self._renewal = None
