"""Rate-limit state in process memory: the embedded default for one gateway process."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proxy.storage.limits import (
    Admission,
    Bucket,
    BucketState,
    SlotPool,
    bucket_state,
    check_scope,
    judge,
    refilled,
)

__all__ = ["MemoryLimitStore"]

_SWEEP_EVERY_S = 3600.0


@dataclass(slots=True)
class _Level:
    tokens: float
    ts: float
    bucket: Bucket  # its capacity and refill rate: when it is full again (and then dropped)


class MemoryLimitStore:
    """Atomic by construction: no method awaits between reading and writing state.

    A bucket that is full is dropped (absent means full), so idle tenants leave no buckets: one
    no request touches again (a revoked key's, a removed tenant's) is dropped by the hourly sweep
    once it has refilled, as Redis expires it then; and so are slot leases past their time.
    """

    def __init__(self) -> None:
        self._levels: dict[str, _Level] = {}
        self._pools: dict[str, dict[str, float]] = {}  # pool key -> lease id -> lease until
        self._sweep_at = 0.0  # when full buckets and expired leases are next dropped

    async def admit(
        self,
        scope: str,
        buckets: Sequence[Bucket],
        costs: Sequence[int],
        slots: Sequence[SlotPool],
        *,
        lease_id: str,
        lease_until: float,
        now: float,
    ) -> Admission:
        check_scope(scope, [*(b.key for b in buckets), *(p.key for p in slots)])
        if now >= self._sweep_at:
            self._sweep(now)
        levels = [self._level(bucket, now) for bucket in buckets]
        held = [self._purged(pool.key, now) for pool in slots]
        admission = judge(buckets, costs, [level.tokens for level in levels], slots, held)
        if admission.admitted:
            for bucket, cost, level in zip(buckets, costs, levels, strict=True):
                self._keep(bucket, level.tokens - cost, level.ts)
            for pool in slots:
                self._pools.setdefault(pool.key, {})[lease_id] = lease_until
        return admission

    async def settle(self, scope: str, bucket: Bucket, delta: int, *, now: float) -> None:
        check_scope(scope, [bucket.key])
        level = self._level(bucket, now)
        self._keep(bucket, min(float(bucket.capacity), level.tokens - delta), level.ts)

    async def release(self, scope: str, slots: Sequence[SlotPool], *, lease_id: str) -> None:
        check_scope(scope, [pool.key for pool in slots])
        for pool in slots:
            leases = self._pools.get(pool.key)
            if leases is not None:
                leases.pop(lease_id, None)
                if not leases:
                    del self._pools[pool.key]

    async def renew(
        self, scope: str, slots: Sequence[SlotPool], *, lease_id: str, lease_until: float
    ) -> bool:
        check_scope(scope, [pool.key for pool in slots])
        pools = [self._pools.get(pool.key, {}) for pool in slots]
        if not all(lease_id in leases for leases in pools):
            return False
        for leases in pools:
            leases[lease_id] = lease_until
        return True

    async def peek(
        self, scope: str, buckets: Sequence[Bucket], *, now: float
    ) -> tuple[BucketState, ...]:
        check_scope(scope, [bucket.key for bucket in buckets])
        return tuple(bucket_state(b, self._level(b, now).tokens) for b in buckets)

    async def held(self, scope: str, slots: Sequence[SlotPool], *, now: float) -> tuple[int, ...]:
        check_scope(scope, [pool.key for pool in slots])
        return tuple(self._purged(pool.key, now) for pool in slots)

    async def aclose(self) -> None:
        return None

    def _level(self, bucket: Bucket, now: float) -> _Level:
        """The bucket refilled to `now`, not yet stored. A level stamped further after `now`
        than a whole refill takes was stamped before the wall clock stepped back: it is stamped
        `now` instead, to refill from now on, not once the clock is back where it was (a lag
        shorter than that refills nothing, as in Redis, where the bucket's own expiry bounds
        the wait; here nothing would)."""
        level = self._levels.get(bucket.key)
        if level is None:
            return _Level(float(bucket.capacity), now, bucket)
        if level.ts - now > bucket.capacity / bucket.refill_per_s:
            level.ts = now
        return _Level(*refilled(bucket, level.tokens, level.ts, now), bucket)

    def _keep(self, bucket: Bucket, tokens: float, ts: float) -> None:
        if tokens >= bucket.capacity:
            self._levels.pop(bucket.key, None)
        else:
            self._levels[bucket.key] = _Level(tokens, ts, bucket)

    def _sweep(self, now: float) -> None:
        for key, level in list(self._levels.items()):
            if refilled(level.bucket, level.tokens, level.ts, now)[0] >= level.bucket.capacity:
                del self._levels[key]
        for key in list(self._pools):
            self._purged(key, now)
        self._sweep_at = now + _SWEEP_EVERY_S

    def _purged(self, key: str, now: float) -> int:
        """Live leases in the pool after dropping those expired at `now`."""
        leases = self._pools.get(key)
        if not leases:
            return 0
        for lease_id in [i for i, until in leases.items() if until <= now]:
            del leases[lease_id]
        if not leases:
            del self._pools[key]
        return len(leases)
