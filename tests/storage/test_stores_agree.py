"""Memory and Redis decide alike: any sequence of quota and rate-limit calls, on a clock that moves
on, gets the same answers and leaves the same counters on both.

The contract suites check chosen cases on each store; here generated sequences (leases that
expire, renewals, settlements larger or smaller than what was held, reservations of nothing,
charges, bucket debts, admissions taken in one call as Prefetch takes them, clocks that jump)
are run on the request path's storage (the facade: memory, or Redis on one link) side by side
and every answer compared, to the last bit of a float. The one difference by design, a lease's
end kept to the whole second on Redis, is kept out by giving both stores whole-second ends.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.storage import Counter
from proxy.storage.facade import RedisStorage, open_storage
from proxy.storage.joint import Admit, Reserve
from proxy.storage.limits import Bucket, SlotPool

SCOPE = "tw:{acme}"
DAY = Counter("tw:{acme}:q:tokens:d:20261129", limit=1000, expires_at=2_000_000_000)
MONTH = Counter("tw:{acme}:q:usd:m:202611", limit=1500, expires_at=2_000_000_000)
COUNTERS = [DAY, MONTH]
RPM = Bucket("tw:{acme}:rl:rpm", capacity=5, refill_per_s=5 / 60)
TPM = Bucket("tw:{acme}:rl:tpm", capacity=900, refill_per_s=15.0)
POOL = SlotPool("tw:{acme}:rl:slots", size=2)
START = 1_800_000_000.25

LEASES = st.sampled_from(["a", "b", "c"])
AMOUNT = st.one_of(st.sampled_from([0, 1, 500]), st.integers(0, 700))
LEASE_S = st.sampled_from([0.5, 5.0, 60.0])
CALLS = st.one_of(
    st.tuples(st.just("reserve"), LEASES, AMOUNT, AMOUNT, LEASE_S),
    st.tuples(st.just("reserve"), LEASES, AMOUNT, st.just(0), LEASE_S),  # an unpriced model
    st.tuples(st.just("settle"), LEASES, AMOUNT, AMOUNT),
    st.tuples(st.just("settle"), LEASES, AMOUNT, st.just(0)),
    st.tuples(st.just("charge"), LEASES, AMOUNT, AMOUNT),
    st.tuples(st.just("renew"), LEASES, LEASE_S),
    st.tuples(st.just("admit"), LEASES, st.integers(0, 6), st.integers(0, 1000), st.booleans(),
              LEASE_S),
    st.tuples(st.just("true_up"), st.integers(-400, 400)),
    st.tuples(st.just("release"), LEASES),
    st.tuples(st.just("keep"), LEASES, LEASE_S),
    st.tuples(st.just("peek")),
    # A request's admission as Prefetch takes it: quota, then limits, in one storage call.
    st.tuples(st.just("joint"), LEASES, AMOUNT, st.integers(0, 6), st.booleans(), LEASE_S),
    st.tuples(st.just("wait"), st.sampled_from([0.001, 0.3, 1.0, 7.5, 61.0])),
)  # fmt: skip


def ends(now: float, lease_s: float) -> int:
    """A lease's end, to the whole second: Redis keeps it rounded up (redis/quota.py says why),
    so a lease there may last up to a second longer than asked; both stores get whole ends."""
    return math.ceil(now + lease_s)


class Stores:
    """The request path's storage (one facade: memory, or Redis on one link), called as the
    gateway calls it."""

    def __init__(self, url: str | None) -> None:
        self.storage = open_storage("memory") if url is None else RedisStorage(url, timeout_s=10.0)
        self.quotas: Any = self.storage.quotas
        self.limits: Any = self.storage.limits

    async def call(self, call: tuple[Any, ...], now: float) -> Any:
        name, *args = call
        quotas, limits = self.quotas, self.limits
        if name == "reserve":
            lease, day, month, lease_s = args
            return await quotas.reserve(
                SCOPE, lease, COUNTERS, [day, month], lease_until=ends(now, lease_s), now=now
            )
        if name == "settle":
            lease, day, month = args
            return await quotas.settle(SCOPE, lease, COUNTERS, [day, month])
        if name == "charge":
            lease, day, month = args
            return await quotas.charge(SCOPE, lease, COUNTERS, [day, month])
        if name == "renew":
            lease, lease_s = args
            return await quotas.renew(SCOPE, lease, lease_until=ends(now, lease_s))
        if name == "admit":
            lease, requests, tokens, pooled, lease_s = args
            slots = [POOL] if pooled else []
            return await limits.admit(
                SCOPE, [RPM, TPM], [requests, tokens], slots,
                lease_id=lease, lease_until=ends(now, lease_s), now=now,
            )  # fmt: skip
        if name == "joint":
            lease, tokens, requests, pooled, lease_s = args
            steps = [
                Reserve(SCOPE, lease, COUNTERS, [tokens, tokens], lease_until=ends(now, lease_s),
                        now=now),
                Admit(SCOPE, [RPM, TPM], [requests, tokens], [POOL] if pooled else [],
                      lease_id=lease, lease_until=ends(now, lease_s), now=now),
            ]  # fmt: skip
            await self.storage.admit(steps)
            return [(step.taken, step.error, step.taken and step.answer) for step in steps]
        if name == "true_up":
            return await limits.settle(SCOPE, TPM, args[0], now=now)
        if name == "release":
            return await limits.release(SCOPE, [POOL], lease_id=args[0])
        if name == "keep":
            lease, lease_s = args
            return await limits.renew(SCOPE, [POOL], lease_id=lease, lease_until=ends(now, lease_s))
        return await limits.peek(SCOPE, [RPM, TPM], now=now)

    async def counters(self) -> list[tuple[int, int]]:
        counters: list[tuple[int, int]] = await self.quotas.read(COUNTERS)
        return counters

    async def aclose(self) -> None:
        await self.quotas.aclose()
        await self.limits.aclose()
        await self.storage.aclose()


async def both(redis_url: str, calls: list[tuple[Any, ...]], check: Callable[..., None]) -> None:
    memory, on_redis = Stores(None), Stores(redis_url)
    # The clock moves on with real time too: Redis drops a full bucket or a pool past its last
    # lease by a TTL in real seconds, so a clock that stood still while the machine was slow
    # would see it there in memory and gone in Redis. Jumps come on top.
    started, waited = time.monotonic(), 0.0
    try:
        for step, call in enumerate(calls):
            if call[0] == "wait":
                waited += call[1]
                continue
            now = START + waited + (time.monotonic() - started)
            said = await memory.call(call, now), await on_redis.call(call, now)
            held = await memory.counters(), await on_redis.counters()
            check(step, call, said, held)
    finally:
        await memory.aclose()
        await on_redis.aclose()


@settings(
    max_examples=100,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(calls=st.lists(CALLS, min_size=1, max_size=30))
def test_memory_and_redis_answer_every_sequence_alike(
    redis_server: str, calls: list[tuple[Any, ...]]
) -> None:
    with redis.Redis.from_url(redis_server) as admin:
        admin.flushdb()

    def check(step: int, call: tuple[Any, ...], said: tuple[Any, Any], held: Any) -> None:
        where = f"step {step}, {call}, after {calls[:step]}"
        assert said[0] == said[1], where
        assert held[0] == held[1], where

    asyncio.run(both(redis_server, calls, check))
