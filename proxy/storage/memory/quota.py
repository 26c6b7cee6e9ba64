"""Quota counters in process memory: the embedded default for one gateway process."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from proxy.storage.base import Counter, Refusal

__all__ = ["MemoryStore"]

_SWEEP_EVERY_S = 3600.0


@dataclass(slots=True)
class _Slot:
    used: int = 0
    reserved: int = 0
    expires_at: float = 0.0


@dataclass(slots=True)
class _Lease:
    until: float
    held: dict[str, int] = field(default_factory=dict)
    booked: dict[str, int] = field(default_factory=dict)  # by its charges, per counter


class MemoryStore:
    """Atomic by construction: no method awaits between reading and writing state."""

    def __init__(self) -> None:
        self._slots: dict[str, _Slot] = {}
        self._leases: dict[str, dict[str, _Lease]] = {}
        self._sweep_at = 0.0  # when counters past their period are next dropped

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
        self._expire(scope, now)
        if now >= self._sweep_at:
            self._sweep(now)
        slots = [self._slot(c, now) for c in counters]
        refusal = _refusing(counters, slots, amounts)
        if refusal is not None:
            self._let_go_orphans(scope, counters, slots)
            refusal = _refusing(counters, slots, amounts)
            if refusal is not None:
                return refusal
        lease = _Lease(lease_until)
        for counter, slot, amount in zip(counters, slots, amounts, strict=True):
            slot.reserved += amount
            lease.held[counter.key] = lease.held.get(counter.key, 0) + amount
        self._leases.setdefault(scope, {})[lease_id] = lease
        return None

    async def renew(self, scope: str, lease_id: str, *, lease_until: float) -> bool:
        lease = self._leases.get(scope, {}).get(lease_id)
        if lease is None:
            return False
        lease.until = lease_until
        return True

    async def settle(
        self,
        scope: str,
        lease_id: str,
        counters: Sequence[Counter],
        used: Sequence[int],
        *,
        booked: Sequence[int] | None = None,
    ) -> None:
        leases = self._leases.get(scope)
        lease = None if leases is None else leases.pop(lease_id, None)
        if lease is not None:
            self._release(lease)
            if not leases:  # a scope with no lease left is dropped: a revoked key's never returns
                del self._leases[scope]
        rest = _rest(counters, used, booked, lease)
        for counter, amount in zip(counters, rest, strict=True):
            slot = self._slots.setdefault(counter.key, _Slot(expires_at=counter.expires_at))
            slot.used = max(0, slot.used + amount)  # as settle.lua: never below zero

    async def settle_held(
        self, scope: str, lease_id: str, counters: Sequence[Counter], used: Sequence[int]
    ) -> bool:
        if lease_id not in self._leases.get(scope, {}):
            return False
        await self.settle(scope, lease_id, counters, used)
        return True

    async def charge(
        self,
        scope: str,
        lease_id: str,
        counters: Sequence[Counter],
        used: Sequence[int],
        *,
        booked: Sequence[int] | None = None,
    ) -> bool:
        lease = self._leases.get(scope, {}).get(lease_id)
        grown = [max(0, r) for r in _rest(counters, used, booked, lease)]
        for counter, total, amount in zip(counters, used, grown, strict=True):
            slot = self._slots.setdefault(counter.key, _Slot(expires_at=counter.expires_at))
            slot.used += amount
            if lease is not None:
                lease.booked[counter.key] = max(total, lease.booked.get(counter.key, 0))
                taken = min(amount, lease.held.get(counter.key, 0))
                if taken > 0:
                    lease.held[counter.key] -= taken
                    slot.reserved = max(0, slot.reserved - taken)
        return lease is not None

    async def read(self, counters: Sequence[Counter]) -> list[tuple[int, int]]:
        found = [self._slots.get(c.key) for c in counters]
        return [(s.used, s.reserved) if s else (0, 0) for s in found]

    async def ping(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    def _slot(self, counter: Counter, now: float) -> _Slot:
        slot = self._slots.get(counter.key)
        if slot is None or slot.expires_at <= now:
            slot = self._slots[counter.key] = _Slot(expires_at=counter.expires_at)
        return slot

    def _sweep(self, now: float) -> None:
        """Drop the counters whose period has ended, as Redis expires them: each day (and each
        month) makes new ones, under keys naming it, and nothing reads the old ones again. And
        the expired leases of every scope: one no request reserves on again (a revoked key's,
        a removed tenant's) would keep them for ever."""
        for scope in list(self._leases):
            self._expire(scope, now)
        for key in [k for k, slot in self._slots.items() if slot.expires_at <= now]:
            del self._slots[key]
        self._sweep_at = now + _SWEEP_EVERY_S

    def _expire(self, scope: str, now: float) -> None:
        leases = self._leases.get(scope)
        if not leases:
            return
        for lease_id in [i for i, lease in leases.items() if lease.until <= now]:
            self._release(leases.pop(lease_id))
        if not leases:
            del self._leases[scope]

    def _let_go_orphans(
        self, scope: str, counters: Sequence[Counter], slots: Sequence[_Slot]
    ) -> None:
        """As reserve.lua before a refusal: no counter holds more than the live leases hold."""
        live: dict[str, int] = {}
        for lease in self._leases.get(scope, {}).values():
            for key, amount in lease.held.items():
                live[key] = live.get(key, 0) + amount
        for counter, slot in zip(counters, slots, strict=True):
            slot.reserved = min(slot.reserved, live.get(counter.key, 0))

    def _release(self, lease: _Lease) -> None:
        for key, amount in lease.held.items():
            slot = self._slots.get(key)
            if slot is not None:
                slot.reserved = max(0, slot.reserved - amount)


def _rest(
    counters: Sequence[Counter],
    used: Sequence[int],
    booked: Sequence[int] | None,
    lease: _Lease | None,
) -> list[int]:
    """`used` less what is booked already: by the lease's charges while it is held, else by
    what the caller counts booked (as charge.lua and settle.lua, which say what that leaves)."""
    if lease is not None:
        return [u - lease.booked.get(c.key, 0) for c, u in zip(counters, used, strict=True)]
    if booked is None:
        return list(used)
    return [u - b for u, b in zip(used, booked, strict=True)]


def _refusing(
    counters: Sequence[Counter], slots: Sequence[_Slot], amounts: Sequence[int]
) -> Refusal | None:
    for index, (counter, slot, amount) in enumerate(zip(counters, slots, amounts, strict=True)):
        if slot.used + slot.reserved + amount > counter.limit:
            return Refusal(index, slot.used, slot.reserved)
    return None
