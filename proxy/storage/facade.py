"""The request path's storage, opened once: quota counters, rate limits and the response cache
on one connection, and `admit`, which takes a request's admission steps in one round trip."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from proxy.storage.base import QuotaStore
from proxy.storage.cache import CacheStore
from proxy.storage.joint import Admit, Lookup, Reserve, Step
from proxy.storage.limits import LimitStore
from proxy.storage.memory.cache import MemoryCacheStore
from proxy.storage.memory.limits import MemoryLimitStore
from proxy.storage.memory.quota import MemoryStore
from proxy.storage.redis.cache import RedisCacheStore
from proxy.storage.redis.limits import RedisLimitStore
from proxy.storage.redis.link import LuaCall, RedisLink
from proxy.storage.redis.quota import RedisStore
from proxy.storage.redis.url import check_storage_url

__all__ = ["RedisStorage", "Storage", "open_storage"]


class Storage:
    """Any three stores; `admit` takes the steps one store call after another (on memory no
    call awaits anything, so they are one atomic step all the same)."""

    def __init__(self, quotas: QuotaStore, limits: LimitStore, cache: CacheStore) -> None:
        self.quotas = quotas
        self.limits = limits
        self.cache = cache

    async def admit(self, steps: Sequence[Step[Any]]) -> None:
        """Take `steps` in order, stopping after the first that refuses or fails; each records
        its outcome (a step not taken records none)."""
        for step in steps:
            await step.run_in(self)
            if step.error is not None or step.refused:
                return

    @property
    def link(self) -> RedisLink | None:
        """The Redis link the stores share, for what else the process keeps there (ended
        sessions, stored-object owners); None on memory."""
        return None

    def with_quotas(self, quotas: QuotaStore) -> Storage:
        """The same storage with other quota counters (tests give their own)."""
        return Storage(quotas, self.limits, self.cache)

    async def aclose(self) -> None:
        """Closes what the stores share (they close themselves)."""
        return None


class RedisStorage(Storage):
    """The three Redis stores on one link: `admit` is one script call."""

    quotas: RedisStore
    limits: RedisLimitStore
    cache: RedisCacheStore

    def __init__(self, url: str, *, timeout_s: float = 1.0) -> None:
        self._link = RedisLink(url, timeout_s=timeout_s)
        super().__init__(
            RedisStore(self._link), RedisLimitStore(self._link), RedisCacheStore(self._link)
        )

    @property
    def link(self) -> RedisLink:
        return self._link

    async def admit(self, steps: Sequence[Step[Any]]) -> None:
        await self._link.run([self._call(step) for step in steps], gate=True)

    def with_quotas(self, quotas: QuotaStore) -> Storage:
        return _Sharing(quotas, self.limits, self.cache, self)

    async def aclose(self) -> None:
        await self._link.aclose()

    def _call(self, step: Step[Any]) -> LuaCall:
        if isinstance(step, Reserve):
            return self.quotas.call(step)
        if isinstance(step, Admit):
            return self.limits.call(step)
        if isinstance(step, Lookup):
            return self.cache.call(step)
        raise TypeError(f"no Redis operation for {type(step).__name__}")


class _Sharing(Storage):
    """Stores of which some are on another storage's link: closing closes that."""

    def __init__(
        self, quotas: QuotaStore, limits: LimitStore, cache: CacheStore, owner: Storage
    ) -> None:
        super().__init__(quotas, limits, cache)
        self._owner = owner

    @property
    def link(self) -> RedisLink | None:
        return self._owner.link

    async def aclose(self) -> None:
        await self._owner.aclose()


def open_storage(url: str) -> Storage:
    """The policy's `storage:`: `memory`, `redis://host:port/db`, a Sentinel-named primary
    (`redis+sentinel://host:port/service`) or a Redis Cluster (`redis+cluster://host:port,...`)."""
    if check_storage_url(url) == "memory":
        return Storage(MemoryStore(), MemoryLimitStore(), MemoryCacheStore())
    return RedisStorage(url)
