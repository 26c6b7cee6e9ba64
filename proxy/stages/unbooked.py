"""Quota settles that storage could not take when a request ended: kept (bounded, per tenant, in
this process's memory) and sent again in the background until storage takes them, once each.

A settle is booked exactly once. One whose call never ran (StorageUnsent, or Redis refused
to write: StorageRefused) is sent whole again. One that may have run (a timeout, a lost
connection) is sent again `held` (settle.lua): applied only while its lease is still held.
The first copy, if it ran, released the lease, so the copy sent again finds none and books
nothing; if it never ran, the lease is held and the copy sent again books it: the request's
whole usage less what the lease records its charges booked, so a charge lost before it is
booked too. Ordering:
- The first copy may still be on its way (Redis hung with it unread): a copy sent again
  first would find the lease held and book, and the first book again after it (it is not
  `held`). So nothing is sent again before two storage timeouts (as resent.py waits): the
  first copy was written before its call timed out, and a copy sent again goes on a new
  connection, written once Redis answers its HELLO: a Redis reading again, which reads the
  older bytes first. One whose backlog on a closed connection outlasts that could still
  book such a request twice.
- Copies sent again are `held`, so any number of them (each timing out in turn, sent
  again) apply at most once between them.
- Storage away past the lease's end: an admission on the tenant's scope releases the
  expired lease, and a copy sent after it books nothing (`settled_before`: the usage is
  in the ledger, not on the quota; the reservation was given back).
- Reload: kept settles belong to the process (services.py), not the policy; they are booked
  on the counters of the day they were admitted in, whatever the policy is now.
- Shutdown (SIGTERM, even during a send): `aclose` stops a send under way (its settles
  are kept again, held), waits for a first copy at most 1.5 s (a first copy landing later
  than that could count twice), sends what is kept once more, and counts what storage still
  did not take `dropped` (logged; the lease ends by itself; the usage is in the ledger).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter as Tally
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from proxy.storage.base import Counter, QuotaStore, StorageError, StorageRefused, StorageUnsent
from proxy.together import cancelled

__all__ = ["MAX_PER_TENANT", "Unbooked", "UnbookedSettle"]

# A tenant's settles kept at most; past it the oldest is dropped (counted), so an outage of any
# length holds bounded memory. About 300 bytes each.
MAX_PER_TENANT = 10_000
_FIRST_DELAY_S, _MAX_DELAY_S = 0.25, 5.0
# A call that timed out has landed or is lost by then: two of the stores' 1 s call timeouts.
# At shutdown at most 1.5 s, so the last send (one timeout) ends within its 3 s step.
_LANDED_S, _LANDED_AT_CLOSE_S = 2.0, 1.5
_log = logging.getLogger("tokenweir.budget")


@dataclass(slots=True)
class UnbookedSettle:
    """One request's settle: release lease `lease_id` in `scope` and book its whole usage,
    `used`, on the counters of the day and month it was admitted in (less what its charges
    booked: as the lease recorded it, or, the lease gone, `booked`). Once a sent copy may have
    run, `held`: sent again only where its lease is still held, and not before `not_before`
    (wall s)."""

    tenant: str
    scope: str
    lease_id: str
    counters: Sequence[Counter]
    used: list[int]
    booked: list[int] | None = None
    held: bool = False
    not_before: float = 0.0


class Unbooked:
    """Settles kept until storage takes them. `keep` takes one whose call failed; a task sends
    every kept one again (in one round trip), backing off while storage refuses."""

    def __init__(self, store: QuotaStore, wall: Callable[[], float]) -> None:
        self._store = store
        self._wall = wall
        self._kept: dict[str, deque[UnbookedSettle]] = {}
        self.counts: Tally[str] = Tally()  # booked_late, settled_before, uncertain, dropped
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def pending(self) -> int:
        return sum(len(kept) for kept in self._kept.values())

    def stats(self) -> dict[str, int]:
        """Settles kept now (`pending`), and since the start: `uncertain` (kept after a call
        that may have run), `booked_late`, `settled_before` (sent again held, their lease was
        no longer held: settled by the first copy, or expired first), `dropped` (never booked:
        past the bound or at shutdown)."""
        outcomes = ("booked_late", "settled_before", "uncertain", "dropped")
        return {"pending": self.pending, **{what: self.counts[what] for what in outcomes}}

    def keep(self, settle: UnbookedSettle, error: StorageError) -> None:
        """Keep `settle`, whose call failed with `error`, to send again."""
        if self._closing:  # a request that ended after the last send: nothing sends it now
            self.counts["dropped"] += 1
            _log.error("shutdown: a quota settle for %s could not be booked", settle.tenant)
            return
        self._again(settle, _never_ran(error), self._wall())
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._retry())

    async def _retry(self) -> None:
        delay_s = _FIRST_DELAY_S
        while self._kept and not self._closing:
            await asyncio.sleep(delay_s)
            took = await self.send()
            delay_s = _FIRST_DELAY_S if took else min(delay_s * 2, _MAX_DELAY_S)

    async def send(self) -> bool:
        """Send every kept settle that may go now, together; True if storage took any."""
        now = self._wall()
        batch, self._kept = self._kept, {}
        sending: list[UnbookedSettle] = []
        for kept in batch.values():
            for settle in kept:
                if settle.not_before > now:
                    self._kept.setdefault(settle.tenant, deque()).append(settle)
                else:
                    sending.append(settle)
        try:
            results = await asyncio.gather(*map(self._call, sending), return_exceptions=True)
        except asyncio.CancelledError:  # shutdown: kept again, as calls that may have run
            for settle in sending:
                self._again(settle, False, now)
            raise
        took = False
        for settle, result in zip(sending, results, strict=True):
            if isinstance(result, StorageError):
                self._again(settle, _never_ran(result), now)
            elif isinstance(result, BaseException):
                raise result
            else:
                took = True
                self.counts["settled_before" if result is False else "booked_late"] += 1
        if took and not self._kept:
            _log.warning("quota storage takes settles again: every kept one is sent")
        return took

    def _call(self, settle: UnbookedSettle) -> Awaitable[bool | None]:
        store, args = self._store, (settle.scope, settle.lease_id, settle.counters, settle.used)
        return (
            store.settle_held(*args) if settle.held else store.settle(*args, booked=settle.booked)
        )

    def _again(self, settle: UnbookedSettle, never_ran: bool, now: float) -> None:
        if not settle.held and not never_ran:  # it may have run: from now on, held
            settle.held, settle.not_before = True, now + _LANDED_S
            self.counts["uncertain"] += 1
        kept = self._kept.setdefault(settle.tenant, deque())
        if len(kept) >= MAX_PER_TENANT:
            kept.popleft()
            self.counts["dropped"] += 1
        kept.append(settle)

    async def aclose(self) -> None:
        """Shutdown, within services.py's 3 s for each step: a send under way is stopped (its
        settles kept again, as calls that may have run), a first copy is waited for at most
        `_LANDED_AT_CLOSE_S`, what is kept is sent one last time, and what storage did not
        take is counted `dropped` and logged, even if this is cut short."""
        self._closing = True
        try:
            await cancelled([self._task])
            waits = [s.not_before for kept in self._kept.values() for s in kept]
            if waits and max(waits) > self._wall():
                await asyncio.sleep(min(max(waits) - self._wall(), _LANDED_AT_CLOSE_S))
            if self._kept:
                await self.send()
        finally:
            if self._kept:
                self.counts["dropped"] += self.pending
                _log.error(
                    "shutdown: %d quota settles could not be booked (storage still refuses): "
                    "their use is in the ledger, not on the quotas",
                    self.pending,
                )
                self._kept = {}


def _never_ran(error: StorageError) -> bool:
    return isinstance(error, StorageUnsent | StorageRefused)
