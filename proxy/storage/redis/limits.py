"""Rate-limit state on Redis, shared by every replica; each operation is one Lua function
(lua/admit.lua, limits_*.lua) run through the link's one script.

Buckets are hashes {tokens, ts} that expire once they would be full again; slot pools are
sorted sets (lease id -> lease expiry) that expire after their latest lease. A lease's expiry
is rounded up to a whole second, as the quota store's (quota.py says why).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Sequence
from typing import Any

from proxy.storage.joint import Admit
from proxy.storage.limits import (
    Admission,
    Bucket,
    BucketState,
    SlotPool,
    bucket_state,
    check_scope,
    judge,
)
from proxy.storage.redis.link import Arg, LuaCall, OnLink, nothing
from proxy.storage.redis.resent import SentAgain

__all__ = ["RedisLimitStore"]


class RedisLimitStore(OnLink):
    """Given a URL, on a link of its own; given a link, on one it shares with the other stores.

    On a Sentinel URL a slot's release is sent again when the sentinels name a new primary
    (resent.py): released on the old one, the slot stayed held on the new one until its lease
    ended (a tenant at `max_concurrent` was refused for a minute). Lease ids are unique, so a
    release applies once however often it is sent."""

    def _opened(self) -> None:
        self._releases = SentAgain(self._link, "limits_release")

    def call(self, step: Admit) -> LuaCall:
        """The admission as one operation of the link's script; its outcome goes to `step`."""
        buckets, costs, slots = step.buckets, step.costs, step.slots
        keys = [*(b.key for b in buckets), *(p.key for p in slots)]
        check_scope(step.scope, keys)
        args: list[Arg] = [step.now, step.lease_id, math.ceil(step.lease_until), len(buckets)]
        for bucket, cost in zip(buckets, costs, strict=True):
            args += [bucket.capacity, bucket.refill_per_s, cost]
        args += [pool.size for pool in slots]

        def answered(reply: Any) -> None:
            tokens = [float(t) for t in reply[1 : len(buckets) + 1]]
            held = [int(n) for n in reply[len(buckets) + 1 :]]
            step.answered(judge(buckets, costs, tokens, slots, held))

        return LuaCall("admit", keys, args, answered, step.failed)

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
        step = Admit(
            scope, buckets, costs, slots, lease_id=lease_id, lease_until=lease_until, now=now
        )
        await self._link.run([self.call(step)])
        return step.answer

    def settle(self, scope: str, bucket: Bucket, delta: int, *, now: float) -> Awaitable[None]:
        check_scope(scope, [bucket.key])
        args: list[Arg] = [bucket.capacity, bucket.refill_per_s, delta, now]
        return self._link.later("limits_settle", [bucket.key], args, nothing)

    def release(self, scope: str, slots: Sequence[SlotPool], *, lease_id: str) -> Awaitable[None]:
        keys = [pool.key for pool in slots]
        check_scope(scope, keys)
        self._releases.sent(keys, [lease_id])
        return self._link.later("limits_release", keys, [lease_id], nothing)

    def renew(
        self, scope: str, slots: Sequence[SlotPool], *, lease_id: str, lease_until: float
    ) -> Awaitable[bool]:
        keys = [pool.key for pool in slots]
        check_scope(scope, keys)
        return self._link.later("limits_renew", keys, [lease_id, math.ceil(lease_until)], bool)

    async def peek(
        self, scope: str, buckets: Sequence[Bucket], *, now: float
    ) -> tuple[BucketState, ...]:
        keys = [bucket.key for bucket in buckets]
        check_scope(scope, keys)
        args: list[Arg] = [now]
        for bucket in buckets:
            args += [bucket.capacity, bucket.refill_per_s]
        reply = await self._link.one("limits_peek", keys, args)
        return tuple(bucket_state(b, float(t)) for b, t in zip(buckets, reply, strict=True))

    async def held(self, scope: str, slots: Sequence[SlotPool], *, now: float) -> tuple[int, ...]:
        keys = [pool.key for pool in slots]
        check_scope(scope, keys)
        reply = await self._link.one("limits_held", keys, [now])
        return tuple(int(n) for n in reply)
