"""Quota counters on Redis, shared by every replica; each operation is one Lua script call.

Keys carry the tenant's hash tag (`tw:{tenant}:...`), so one tenant's keys share a Redis Cluster
slot and a script may touch them together. redis-py errors become StorageError here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from importlib import resources
from typing import Any

from proxy.storage.base import Counter, Refusal
from proxy.storage.redisconn import Call, StoreRedis, send_all, translated

__all__ = ["RedisStore"]


def _script(name: str, *, prelude: bool = False) -> str:
    lua = resources.files("proxy.storage") / "lua"
    body = (lua / name).read_text(encoding="utf-8")
    return (lua / "release_expired.lua").read_text(encoding="utf-8") + body if prelude else body


class RedisStore:
    def __init__(
        self, url: str, *, timeout_s: float = 1.0, max_connections: int = 64, multiplex: bool = True
    ) -> None:
        self._conn = StoreRedis(
            url, timeout_s=timeout_s, max_connections=max_connections, multiplex=multiplex
        )
        scripts = self._conn.scripts
        self._reserve = scripts.register_script(_script("reserve.lua", prelude=True))
        self._settle = scripts.register_script(_script("settle.lua", prelude=True))
        self._renew = scripts.register_script(_script("renew.lua"))
        self._charge = scripts.register_script(_script("charge.lua"))

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
        args: list[Any] = [lease_id, lease_until, now]
        for counter, amount in zip(counters, amounts, strict=True):
            args += [counter.limit, amount, math.ceil(counter.expires_at)]
        with translated():
            answer = await self._reserve(keys=_keys(scope, counters), args=args)
        if not answer:
            return None
        index, used, reserved = (int(x) for x in answer)
        return Refusal(index, used, reserved)

    async def renew(self, scope: str, lease_id: str, *, lease_until: float) -> bool:
        with translated():
            return bool(await self._renew(keys=[scope + ":leases"], args=[lease_id, lease_until]))

    async def settle(
        self, scope: str, lease_id: str, counters: Sequence[Counter], used: Sequence[int]
    ) -> None:
        with translated():
            await self._settle(keys=_keys(scope, counters), args=_booking(lease_id, counters, used))

    async def charge(
        self, scope: str, lease_id: str, counters: Sequence[Counter], amounts: Sequence[int]
    ) -> bool:
        args = _booking(lease_id, counters, amounts)
        with translated():
            return bool(await self._charge(keys=_keys(scope, counters), args=args))

    async def read(self, counters: Sequence[Counter]) -> list[tuple[int, int]]:
        with translated():
            rows = await send_all(self._conn.client, [_used_and_reserved(c.key) for c in counters])
        return [(int(used or 0), int(reserved or 0)) for used, reserved in rows]

    async def ping(self) -> None:
        with translated():
            await self._conn.scripts.ping()

    async def aclose(self) -> None:
        await self._conn.aclose()


def _used_and_reserved(key: str) -> Call:
    return lambda client: client.hmget(key, "used", "reserved")


def _booking(lease_id: str, counters: Sequence[Counter], amounts: Sequence[int]) -> list[Any]:
    """ARGV of settle.lua and charge.lua: the lease, then each counter's amount and expiry."""
    args: list[Any] = [lease_id]
    for counter, amount in zip(counters, amounts, strict=True):
        args += [amount, math.ceil(counter.expires_at)]
    return args


def _keys(scope: str, counters: Sequence[Counter]) -> list[str]:
    return [scope + ":leases", scope + ":lease_holdings", *(c.key for c in counters)]
