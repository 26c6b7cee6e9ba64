"""A request's admission as steps that storage may take together, in one round trip: a quota
reservation, a rate-limit admission, a cache lookup. Each step records its outcome: its answer,
the StorageError it met, or neither (not taken: an earlier step refused or failed).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from proxy.storage.base import Counter, QuotaStore, Refusal, StorageError
from proxy.storage.cache import CacheStore
from proxy.storage.limits import Admission, Bucket, LimitStore, SlotPool

__all__ = ["Admit", "Lookup", "Reserve", "Step", "Stores", "Undo"]

T = TypeVar("T")
Undo = tuple[Callable[[], Awaitable[None]], float]
"""A call that gives back what a step took, and within how long that matters (its lease)."""


class Stores(Protocol):
    """The stores a step may run on."""

    @property
    def quotas(self) -> QuotaStore: ...

    @property
    def limits(self) -> LimitStore: ...

    @property
    def cache(self) -> CacheStore: ...


@dataclass(slots=True, eq=False)
class Step(Generic[T]):
    """One store call and its outcome."""

    taken: bool = field(default=False, kw_only=True)
    error: StorageError | None = field(default=None, kw_only=True)
    _answer: T | None = field(default=None, kw_only=True)

    @property
    def answer(self) -> T:
        """What the store answered; raises the StorageError the step met."""
        if self.error is not None:
            raise self.error
        if not self.taken:
            raise RuntimeError("the step was not taken")
        return self._answer  # type: ignore[return-value]

    @property
    def refused(self) -> bool:
        """True when taken and refused: the steps after it were not taken."""
        return False

    def answered(self, answer: T) -> None:
        self.taken, self._answer = True, answer

    def failed(self, error: StorageError) -> None:
        self.taken, self.error = True, error

    async def run_in(self, stores: Stores) -> None:
        """Take the step with its own store's call."""
        raise NotImplementedError

    def undo_in(self, stores: Stores) -> Undo | None:
        """What gives back what the step may hold (if it ran late, after timing out), and
        within how long that matters; None when it holds nothing."""
        return None

    async def _take(self, call: Awaitable[T]) -> None:
        try:
            answer = await call
        except StorageError as exc:
            self.failed(exc)
        else:
            self.answered(answer)


@dataclass(slots=True, eq=False)
class Reserve(Step[Refusal | None]):
    """QuotaStore.reserve's arguments."""

    scope: str
    lease_id: str
    counters: Sequence[Counter]
    amounts: Sequence[int]
    lease_until: float
    now: float

    @property
    def refused(self) -> bool:
        return self.taken and self.error is None and self._answer is not None

    async def run(self, store: QuotaStore) -> None:
        reserving = store.reserve(
            self.scope, self.lease_id, self.counters, self.amounts,
            lease_until=self.lease_until, now=self.now,
        )  # fmt: skip
        await self._take(reserving)

    async def run_in(self, stores: Stores) -> None:
        await self.run(stores.quotas)

    def undo_in(self, stores: Stores) -> Undo | None:
        return self.undo(stores.quotas)

    def undo(self, store: QuotaStore) -> Undo:
        nothing = [0] * len(self.counters)
        return (
            lambda: store.settle(self.scope, self.lease_id, self.counters, nothing),
            self.lease_until - self.now,
        )


@dataclass(slots=True, eq=False)
class Admit(Step[Admission]):
    """LimitStore.admit's arguments."""

    scope: str
    buckets: Sequence[Bucket]
    costs: Sequence[int]
    slots: Sequence[SlotPool]
    lease_id: str
    lease_until: float
    now: float

    @property
    def refused(self) -> bool:
        return self.taken and self.error is None and not self.answer.admitted

    async def run(self, store: LimitStore) -> None:
        admitting = store.admit(
            self.scope, self.buckets, self.costs, self.slots,
            lease_id=self.lease_id, lease_until=self.lease_until, now=self.now,
        )  # fmt: skip
        await self._take(admitting)

    async def run_in(self, stores: Stores) -> None:
        await self.run(stores.limits)

    def undo_in(self, stores: Stores) -> Undo | None:
        return self.undo(stores.limits)

    def undo(self, store: LimitStore) -> Undo | None:
        if not self.slots:
            return None
        return (
            lambda: store.release(self.scope, self.slots, lease_id=self.lease_id),
            self.lease_until - self.now,
        )


@dataclass(slots=True, eq=False)
class Lookup(Step[bytes | None]):
    """CacheStore.get's arguments."""

    tenant: str
    key: str
    now: float

    async def run(self, store: CacheStore) -> None:
        await self._take(store.get(self.tenant, self.key, now=self.now))

    async def run_in(self, stores: Stores) -> None:
        await self.run(stores.cache)
