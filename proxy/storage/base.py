"""The storage contract: quota counters with leased reservations, atomic in every implementation.

A quota counter holds `used` (settled) and `reserved` (held by requests in flight). A request
reserves on several counters at once or on none; its reservation is a lease that expires if the
replica holding it dies, so a crash never leaks quota for longer than the lease. A long request
books its usage so far as it runs (`charge`), so a crash loses at most what came since.
Charges and settles carry the request's whole usage (so far, or final): the lease records what
it booked, and each books only the rest, so a call lost, run twice or run late books it once.
`renew`, `settle` and `charge` are sent when called, not when awaited (Redis sends the calls of
one turn of the event loop together): a caller with several makes them all, then awaits them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "Counter",
    "QuotaStore",
    "Refusal",
    "StorageError",
    "StorageRefused",
    "StorageTimeout",
    "StorageUnreachable",
    "StorageUnsent",
]


class StorageError(Exception):
    """The storage could not be reached or answered wrongly; callers apply their failure policy.

    StorageError             an error reply, or trouble of no kind below
     +- StorageRefused       refused to write before changing anything: nothing of it ran
     +- StorageTimeout       no answer in time: the call may still run once the storage catches up
     +- StorageUnreachable   no connection (refused, lost or closed)
         +- StorageUnsent    the call reached no storage: nothing of it ran
    """


class StorageRefused(StorageError):
    """Redis answered but takes no writes now (full under noeviction: OOM; a read-only replica:
    READONLY; a failed RDB save: MISCONF; too few replicas: NOREPLICAS). It refuses a script's
    first write, before any other, so nothing of the call ran and what it carried may be sent
    again."""


class StorageTimeout(StorageError):
    """A call had no answer within its timeout: it may have run, or run later, and taken what
    nobody gives back until its lease ends (StorageFailures.undo_later)."""


class StorageUnreachable(StorageError):
    """The storage could not be connected to, or the connection was lost or closed."""


class StorageUnsent(StorageUnreachable):
    """The call was never sent: no connection could be opened (no primary known to Redis
    Sentinel, say), so nothing of it ran, and what it carried may be sent again."""


@dataclass(frozen=True, slots=True)
class Counter:
    """A quota counter: `key` (with the tenant's hash tag) names it; `limit` caps used+reserved."""

    key: str
    limit: int
    expires_at: float  # wall seconds after which the counter's period is over and it may go


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a reservation was refused: the first counter that could not hold it, as it stood."""

    index: int
    used: int
    reserved: int


class QuotaStore(Protocol):
    async def reserve(
        self,
        scope: str,
        lease_id: str,
        counters: Sequence[Counter],
        amounts: Sequence[int],
        *,
        lease_until: float,
        now: float,
    ) -> Refusal | None:
        """Hold `amounts` on all `counters` or on none; None when held. Expired leases in
        `scope` (the tenant's key prefix) are released first."""

    def renew(self, scope: str, lease_id: str, *, lease_until: float) -> Awaitable[bool]:
        """Extend a held lease; False if it had already expired and been released."""

    def settle(
        self,
        scope: str,
        lease_id: str,
        counters: Sequence[Counter],
        used: Sequence[int],
        *,
        booked: Sequence[int] | None = None,
    ) -> Awaitable[None]:
        """Release the lease's reservation and book the request's whole `used` amounts, less
        what its charges booked, atomically (less than they booked gives the difference back;
        `used` never goes below zero). On a lease no longer held (expired and released, or
        lost by storage), what its charges booked is gone with it: `used - booked` is booked,
        `booked` being what the caller counts booked (None: nothing)."""

    def settle_held(
        self,
        scope: str,
        lease_id: str,
        counters: Sequence[Counter],
        used: Sequence[int],
    ) -> Awaitable[bool]:
        """`settle`, only while the lease is still held (never settled, not expired): True if it
        applied. Safe to send again: a settle whose call may have run (stages/unbooked.py)."""

    def charge(
        self,
        scope: str,
        lease_id: str,
        counters: Sequence[Counter],
        used: Sequence[int],
        *,
        booked: Sequence[int] | None = None,
    ) -> Awaitable[bool]:
        """Book a running request's usage so far, `used`: what grew beyond what the lease's
        charges booked goes to `used` and off the lease's reservation (never below zero),
        atomically, so used + reserved stays put; the lease keeps the rest. A charge lost on
        its way is made up by the next or the settle; one run twice or late books nothing more.
        False if the lease had already expired or been settled: then `used - booked` (not
        below zero) is booked all the same, it was used."""

    async def read(self, counters: Sequence[Counter]) -> list[tuple[int, int]]:
        """(used, reserved) of each counter."""

    async def ping(self) -> None:
        """Return when the storage answers and would take a write; StorageError when not."""

    async def aclose(self) -> None: ...
