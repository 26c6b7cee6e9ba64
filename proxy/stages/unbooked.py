"""Quota settles that storage could not take when a request ended: kept (bounded, per tenant, in
this process's memory) and sent again in the background until storage takes them, once each."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter as Tally
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from proxy.storage.base import Counter, QuotaStore, StorageError, StorageRefused, StorageUnsent

__all__ = ["MAX_PER_TENANT", "Unbooked", "UnbookedSettle"]

# A tenant's settles kept at most; past it the oldest is dropped (counted), so an outage of any
# length holds bounded memory. About 300 bytes each.
MAX_PER_TENANT = 10_000
_FIRST_DELAY_S, _MAX_DELAY_S = 0.25, 5.0
_log = logging.getLogger("tokenweir.budget")


@dataclass(slots=True)
class UnbookedSettle:
    """One request's settle: release lease `lease_id` in `scope` and add `amounts` to the
    counters of the day and month it was admitted in. `release_until` (wall seconds) is set
    once a sent copy may have run: from then on only the release is sent again (safe to
    repeat), and only until the lease would have ended on its own."""

    tenant: str
    scope: str
    lease_id: str
    counters: Sequence[Counter]
    amounts: list[int]
    lease_s: float
    release_until: float | None = None


class Unbooked:
    """Settles kept until storage takes them. `keep` takes one whose call failed; a task sends
    every kept one again (in one round trip), backing off while storage refuses.

    A settle is booked exactly once: one whose call never ran (StorageUnsent, or Redis refused
    to write: StorageRefused) is sent whole again; one that may have run (a timeout, a lost
    connection) has only its lease released (settle.lua releases before it books, and a
    release repeated does nothing), and its amounts are counted `uncertain`, never booked twice.
    """

    def __init__(self, store: QuotaStore, wall: Callable[[], float]) -> None:
        self._store = store
        self._wall = wall
        self._kept: dict[str, deque[UnbookedSettle]] = {}
        self.counts: Tally[str] = Tally()  # booked_late, released, dropped, uncertain
        self._task: asyncio.Task[None] | None = None
        self._woken = asyncio.Event()
        self._closing = False

    @property
    def pending(self) -> int:
        return sum(len(kept) for kept in self._kept.values())

    def stats(self) -> dict[str, int]:
        """Settles kept now (`pending`), and by outcome since the start: `booked_late`,
        `released` (only the lease: `uncertain`, it may have run), `dropped` (never booked)."""
        outcomes = ("booked_late", "released", "uncertain", "dropped")
        return {"pending": self.pending, **{what: self.counts[what] for what in outcomes}}

    def keep(self, settle: UnbookedSettle, error: StorageError) -> None:
        """Keep `settle`, whose call failed with `error`, to send again."""
        if self._closing:  # a request that ended after the last send: nothing sends it now
            self.counts["dropped"] += 1
            _log.error("shutdown: a quota settle for %s could not be booked", settle.tenant)
            return
        self._again(settle, error, self._wall())
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._retry())

    def _uncertain(self, settle: UnbookedSettle, now: float) -> None:
        """A sent copy may have run: from now on only its lease is released."""
        if settle.release_until is None:
            settle.release_until = now + settle.lease_s
            self.counts["uncertain"] += 1
            settle.amounts = [0] * len(settle.amounts)

    async def _retry(self) -> None:
        delay_s = _FIRST_DELAY_S
        while self._kept and not self._closing:
            try:
                async with asyncio.timeout(delay_s):
                    await self._woken.wait()
            except TimeoutError:
                pass
            took = await self.send()
            delay_s = _FIRST_DELAY_S if took else min(delay_s * 2, _MAX_DELAY_S)

    async def send(self) -> bool:
        """Send every kept settle once, together; True if storage took any."""
        now = self._wall()
        batch = [s for kept in self._kept.values() for s in kept]
        self._kept = {}
        calls = [self._store.settle(s.scope, s.lease_id, s.counters, s.amounts) for s in batch]
        results = await asyncio.gather(*calls, return_exceptions=True)
        took = False
        for settle, result in zip(batch, results, strict=True):
            if isinstance(result, StorageError):
                self._again(settle, result, now)
            elif isinstance(result, BaseException):
                raise result
            else:
                took = True
                self.counts["released" if settle.release_until else "booked_late"] += 1
        if took and not self._kept:
            _log.warning("quota storage takes settles again: every kept one is booked")
        return took

    def _again(self, settle: UnbookedSettle, error: StorageError, now: float) -> None:
        if not _never_ran(error):
            self._uncertain(settle, now)
        if settle.release_until is not None and now > settle.release_until:
            return  # the lease has ended: storage gives its reservation back by itself
        kept = self._kept.setdefault(settle.tenant, deque())
        if len(kept) >= MAX_PER_TENANT:
            kept.popleft()
            self.counts["dropped"] += 1
        kept.append(settle)

    async def aclose(self) -> None:
        """Shutdown: send what is kept one last time (at once); log what could not be booked."""
        self._closing = True
        self._woken.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        if self._kept:
            await self.send()
        if self._kept:
            self.counts["dropped"] += self.pending
            _log.error(
                "shutdown: %d quota settles could not be booked (storage still refuses): their "
                "use is in the ledger, not on the quotas",
                self.pending,
            )
            self._kept = {}


def _never_ran(error: StorageError) -> bool:
    return isinstance(error, StorageUnsent | StorageRefused)
