"""Rate-limit state on Redis, shared by every replica; each operation is one Lua script call.

Buckets are hashes {tokens, ts} that expire once they would be full again; slot pools are
sorted sets (lease id -> lease expiry) that expire after their latest lease. redis-py errors
become StorageError here.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from typing import Any

from proxy.storage.limits import (
    Admission,
    Bucket,
    BucketState,
    SlotPool,
    bucket_state,
    check_scope,
    judge,
)
from proxy.storage.redisconn import StoreRedis, translated

__all__ = ["RedisLimitStore"]


def _script(name: str, *, bucket_prelude: bool = False) -> str:
    lua = resources.files("proxy.storage") / "lua"
    body = (lua / name).read_text(encoding="utf-8")
    if not bucket_prelude:
        return body
    return (lua / "limits_bucket.lua").read_text(encoding="utf-8") + body


class RedisLimitStore:
    def __init__(
        self, url: str, *, timeout_s: float = 1.0, max_connections: int = 64, multiplex: bool = True
    ) -> None:
        self._conn = StoreRedis(
            url, timeout_s=timeout_s, max_connections=max_connections, multiplex=multiplex
        )
        scripts = self._conn.scripts
        self._admit = scripts.register_script(_script("admit.lua", bucket_prelude=True))
        self._settle = scripts.register_script(_script("limits_settle.lua", bucket_prelude=True))
        self._peek = scripts.register_script(_script("limits_peek.lua", bucket_prelude=True))
        self._release = scripts.register_script(_script("limits_release.lua"))
        self._renew = scripts.register_script(_script("limits_renew.lua"))

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
        keys = [*(b.key for b in buckets), *(p.key for p in slots)]
        check_scope(scope, keys)
        args: list[Any] = [now, lease_id, lease_until, len(buckets)]
        for bucket, cost in zip(buckets, costs, strict=True):
            args += [bucket.capacity, bucket.refill_per_s, cost]
        args += [pool.size for pool in slots]
        with translated():
            reply = await self._admit(keys=keys, args=args)
        tokens = [float(t) for t in reply[1 : len(buckets) + 1]]
        held = [int(n) for n in reply[len(buckets) + 1 :]]
        return judge(buckets, costs, tokens, slots, held)

    async def settle(self, scope: str, bucket: Bucket, delta: int, *, now: float) -> None:
        check_scope(scope, [bucket.key])
        args = [bucket.capacity, bucket.refill_per_s, delta, now]
        with translated():
            await self._settle(keys=[bucket.key], args=args)

    async def release(self, scope: str, slots: Sequence[SlotPool], *, lease_id: str) -> None:
        keys = [pool.key for pool in slots]
        check_scope(scope, keys)
        with translated():
            await self._release(keys=keys, args=[lease_id])

    async def renew(
        self, scope: str, slots: Sequence[SlotPool], *, lease_id: str, lease_until: float
    ) -> bool:
        keys = [pool.key for pool in slots]
        check_scope(scope, keys)
        with translated():
            return bool(await self._renew(keys=keys, args=[lease_id, lease_until]))

    async def peek(
        self, scope: str, buckets: Sequence[Bucket], *, now: float
    ) -> tuple[BucketState, ...]:
        keys = [bucket.key for bucket in buckets]
        check_scope(scope, keys)
        args: list[Any] = [now]
        for bucket in buckets:
            args += [bucket.capacity, bucket.refill_per_s]
        with translated():
            reply = await self._peek(keys=keys, args=args)
        return tuple(bucket_state(b, float(t)) for b, t in zip(buckets, reply, strict=True))

    async def ping(self) -> None:
        with translated():
            await self._conn.scripts.ping()

    async def aclose(self) -> None:
        await self._conn.aclose()
