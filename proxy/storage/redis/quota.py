"""Quota counters on Redis, shared by every replica; each operation is one Lua function
(lua/reserve.lua, settle.lua, charge.lua, renew.lua) run through the link's one script.

Keys carry the tenant's hash tag (`tw:{tenant}:...`), so one tenant's keys share a Redis Cluster
slot and a script may touch them together.

A lease's expiry (its score in the `leases` sorted set) is rounded up to a whole second: a
small sorted set is a listpack, which keeps an integral score as an integer and any other as
text that every insert and range reads back with strtod (17 digits: glibc's slow path), about
a tenth of Redis's CPU for an admission and its settlement at 64 leases held
(benchmarks/redis_scores.py). A lease may last up to a second longer than asked on Redis; a
lease is at least a second (`lease_ttl`) and is renewed long before its end.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Sequence
from typing import Any

from proxy.storage.base import Counter, Refusal
from proxy.storage.joint import Reserve
from proxy.storage.redis.conn import Call, send_all, translated
from proxy.storage.redis.link import Arg, LuaCall, OnLink, nothing
from proxy.storage.redis.resent import SentAgain

__all__ = ["RedisStore"]


class RedisStore(OnLink):
    """Given a URL, on a link of its own; given a link, on one it shares with the other stores.

    On a Sentinel URL a settle is sent again when the sentinels name a new primary (resent.py),
    applied there only if the new primary still holds the lease (it never took the settle):
    settled on the old one, the reservation stayed held until its lease ended and the usage
    was not booked."""

    def _opened(self) -> None:
        self._settles = SentAgain(self._link, "settle", ["held"])

    def call(self, step: Reserve) -> LuaCall:
        """The reservation as one operation of the link's script; its outcome goes to `step`."""
        args: list[Arg] = [step.lease_id, math.ceil(step.lease_until), step.now]
        for counter, amount in zip(step.counters, step.amounts, strict=True):
            args += [counter.limit, amount, math.ceil(counter.expires_at)]
        return LuaCall(
            "reserve",
            _keys(step.scope, step.counters),
            args,
            lambda reply: step.answered(_refusal(reply)),
            step.failed,
        )

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
        step = Reserve(scope, lease_id, counters, amounts, lease_until=lease_until, now=now)
        await self._link.run([self.call(step)])
        return step.answer

    def renew(self, scope: str, lease_id: str, *, lease_until: float) -> Awaitable[bool]:
        until = math.ceil(lease_until)
        return self._link.later("renew", [scope + ":leases"], [lease_id, until], bool)

    def settle(
        self,
        scope: str,
        lease_id: str,
        counters: Sequence[Counter],
        used: Sequence[int],
        *,
        booked: Sequence[int] | None = None,
    ) -> Awaitable[None]:
        keys, args = _keys(scope, counters), _booking(lease_id, counters, used, booked)
        self._settles.sent(keys, args)
        return self._link.later("settle", keys, args, nothing)

    def settle_held(
        self, scope: str, lease_id: str, counters: Sequence[Counter], used: Sequence[int]
    ) -> Awaitable[bool]:
        keys, args = _keys(scope, counters), _booking(lease_id, counters, used, None)
        return self._link.later("settle", keys, [*args, "held"], bool)

    def charge(
        self,
        scope: str,
        lease_id: str,
        counters: Sequence[Counter],
        used: Sequence[int],
        *,
        booked: Sequence[int] | None = None,
    ) -> Awaitable[bool]:
        keys, args = _keys(scope, counters), _booking(lease_id, counters, used, booked)
        return self._link.later("charge", keys, args, bool)

    async def read(self, counters: Sequence[Counter]) -> list[tuple[int, int]]:
        with translated():
            rows = await send_all(self._link.client, [_used_and_reserved(c.key) for c in counters])
        return [(int(used or 0), int(reserved or 0)) for used, reserved in rows]


def _refusal(reply: Any) -> Refusal | None:
    if not reply:
        return None
    index, used, reserved = (int(x) for x in reply)
    return Refusal(index, used, reserved)


def _used_and_reserved(key: str) -> Call:
    return lambda client: client.hmget(key, "used", "reserved")


def _booking(
    lease_id: str, counters: Sequence[Counter], used: Sequence[int], booked: Sequence[int] | None
) -> list[Arg]:
    """ARGV of settle.lua and charge.lua: the lease, then each counter's usage, what the caller
    counts booked of it (used only where the lease is gone), and expiry."""
    args: list[Arg] = [lease_id]
    booked = booked if booked is not None else [0] * len(counters)
    for counter, amount, before in zip(counters, used, booked, strict=True):
        args += [amount, before, math.ceil(counter.expires_at)]
    return args


def _keys(scope: str, counters: Sequence[Counter]) -> list[str]:
    return [scope + ":leases", scope + ":lease_holdings", *(c.key for c in counters)]
