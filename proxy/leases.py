"""A request's leases (a quota reservation, concurrency slots): their ids, and their renewal
while it runs, on the injected clock (see Renewals)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from proxy.clock import Clock, Timer
from proxy.storage.base import StorageError

__all__ = ["Lease", "LeaseIds", "Renewals"]


class LeaseIds:
    """Ids no other lease has, on this replica or another: a random prefix per maker, then a
    count (os.urandom per lease is a system call; an id needs to be unique, not secret)."""

    __slots__ = ("_count", "_prefix")

    def __init__(self) -> None:
        self._prefix = secrets.token_hex(8)
        self._count = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._count):x}"


class Renewals:
    """Renews the leases it keeps while their requests run: each when a third of its length has
    passed since it was taken or last renewed, until a lease's length after now on `clock`. One
    timer for all the leases of one length, ticking every sixth of it while any is kept, so a
    lease is renewed between a third and a half of its length after the last time (a timer per
    lease cost a loop timer's making and cancelling on every request, for the rare request that
    outlives a third of a lease). A renewal that fails is logged as `what` and the next one is
    tried all the same."""

    __slots__ = ("_clock", "_log", "_rings", "_what")

    def __init__(self, clock: Clock, log: logging.Logger, what: str) -> None:
        self._clock = clock
        self._log = log
        self._what = what
        self._rings: dict[float, _Ring] = {}

    def keep(self, lease: Lease, renew: Callable[[float], Awaitable[object]]) -> None:
        """Call `renew(until)` for `lease` as said above, until `lease.end()`."""
        ring = self._rings.get(lease.lease_s)
        if ring is None:
            ring = self._rings[lease.lease_s] = _Ring(lease.lease_s, self._clock, self._done)
        ring.add(lease, renew)

    def _done(self, renewal: asyncio.Future[object]) -> None:
        if renewal.cancelled():
            return
        error = renewal.exception()
        if isinstance(error, StorageError):
            self._log.warning("could not renew %s: %s", self._what, error)
        elif error is not None:
            raise error


class _Ring:
    """The leases of one length that `Renewals` keeps, by id, with when each was last renewed."""

    __slots__ = ("_clock", "_done", "_every_s", "_held", "_tick_s", "_timer", "lease_s")

    def __init__(
        self, lease_s: float, clock: Clock, done: Callable[[asyncio.Future[object]], None]
    ) -> None:
        self.lease_s = lease_s
        self._every_s = lease_s / 3
        self._tick_s = lease_s / 6
        self._clock = clock
        self._done = done  # sees each renewal's outcome
        self._held: dict[str, tuple[Callable[[float], Awaitable[object]], float]] = {}
        self._timer: Timer | None = None

    def add(self, lease: Lease, renew: Callable[[float], Awaitable[object]]) -> None:
        self._held[lease.lease_id] = (renew, self._clock.monotonic())
        lease._kept = self
        if self._timer is None:
            self._timer = self._clock.call_later(self._tick_s, self._tick)

    def drop(self, lease_id: str) -> None:
        self._held.pop(lease_id, None)

    def _tick(self) -> None:
        if not self._held:  # started again by the next lease kept
            self._timer = None
            return
        clock = self._clock
        self._timer = clock.call_later(self._tick_s, self._tick)
        now = clock.monotonic()
        until = clock.wall() + self.lease_s
        for lease_id, (renew, last) in list(self._held.items()):
            if now - last >= self._every_s:
                self._held[lease_id] = (renew, now)
                asyncio.ensure_future(renew(until)).add_done_callback(self._done)


@dataclass(slots=True)
class Lease:
    """A lease a request holds on storage until it is settled: its id, the scope of its keys (the
    owner's hash tag), and its length. `Renewals.keep` renews it while the request runs, `end`
    stops."""

    scope: str
    lease_id: str
    lease_s: float
    _kept: _Ring | None = field(default=None, init=False, repr=False)

    def end(self) -> None:
        """Stop renewing (settling gives the lease back)."""
        if self._kept is not None:
            self._kept.drop(self.lease_id)
            self._kept = None
