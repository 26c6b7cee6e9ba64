"""One contract, every storage: all-or-nothing reservations, expiring leases, exact settling."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis

from proxy.storage import Counter, MemoryStore, QuotaStore, RedisStore, Refusal

SCOPE = "tw:{acme}"
DAY = Counter("tw:{acme}:q:tokens:d:20261129", limit=1000, expires_at=2_000_000_000)
MONTH = Counter("tw:{acme}:q:tokens:m:202611", limit=1500, expires_at=2_000_000_000)
NOW = 1_800_000_000.0


@pytest.fixture
async def store(storage_url: str) -> AsyncIterator[QuotaStore]:
    # A generous storage timeout: these tests check what the store decides, not how fast; 300
    # calls queued for a Redis Cluster's pool took over the 1 s default on a loaded machine.
    chosen: QuotaStore = (
        MemoryStore() if storage_url == "memory" else RedisStore(storage_url, timeout_s=10.0)
    )
    yield chosen
    await chosen.aclose()


pytestmark = pytest.mark.anyio


async def reserve(
    store: QuotaStore, lease: str, amounts: list[int], until: float = NOW + 60
) -> Refusal | None:
    return await store.reserve(SCOPE, lease, [DAY, MONTH], amounts, lease_until=until, now=NOW)


async def test_reserve_holds_on_all_counters_and_settle_makes_it_used(store: QuotaStore) -> None:
    assert await reserve(store, "r1", [300, 300]) is None
    assert await store.read([DAY, MONTH]) == [(0, 300), (0, 300)]
    await store.settle(SCOPE, "r1", [DAY, MONTH], [120, 120])
    assert await store.read([DAY, MONTH]) == [(120, 0), (120, 0)]


async def test_a_settle_sent_again_held_applies_once_and_only_on_a_held_lease(
    store: QuotaStore,
) -> None:
    """`settle_held`, for a settle whose first call may have run: it books while the lease is
    held (the first never ran), and nothing once it is settled (the first ran)."""
    assert await reserve(store, "r1", [300, 300]) is None
    assert await store.settle_held(SCOPE, "r1", [DAY, MONTH], [120, 120])
    assert not await store.settle_held(SCOPE, "r1", [DAY, MONTH], [120, 120])
    assert await store.read([DAY, MONTH]) == [(120, 0), (120, 0)]
    assert await reserve(store, "r2", [200, 200]) is None
    await store.settle(SCOPE, "r2", [DAY, MONTH], [50, 50])
    assert not await store.settle_held(SCOPE, "r2", [DAY, MONTH], [50, 50])
    assert await store.read([DAY, MONTH]) == [(170, 0), (170, 0)]


async def test_a_reservation_over_any_limit_holds_nothing(store: QuotaStore) -> None:
    assert await reserve(store, "r1", [900, 900]) is None
    refusal = await reserve(store, "r2", [50, 700])
    assert refusal is not None
    assert (refusal.index, refusal.used, refusal.reserved) == (1, 0, 900)
    assert await store.read([DAY, MONTH]) == [(0, 900), (0, 900)]


async def test_expired_leases_are_released_by_the_next_reservation(store: QuotaStore) -> None:
    assert await reserve(store, "crashed", [1000, 1000], until=NOW - 1) is None
    assert await reserve(store, "next", [600, 600]) is None
    assert await store.read([DAY, MONTH]) == [(0, 600), (0, 600)]


async def test_renew_keeps_a_lease_and_settling_an_expired_one_still_counts_use(
    store: QuotaStore,
) -> None:
    assert await reserve(store, "long", [400, 400], until=NOW + 1) is None
    assert await store.renew(SCOPE, "long", lease_until=NOW + 100)
    assert await reserve(store, "other", [100, 100]) is None
    assert await store.read([DAY]) == [(0, 500)]
    assert not await store.renew(SCOPE, "never-held", lease_until=NOW + 100)
    await store.settle(SCOPE, "never-held", [DAY, MONTH], [7, 7])
    assert await store.read([DAY]) == [(7, 500)]


async def test_a_reservation_of_nothing_on_a_counter_settles_and_expires_cleanly(
    store: QuotaStore,
) -> None:
    """A USD quota on a model with no price reserves 0 on its counter: the request settles,
    its use is booked, and once such a lease expires unsettled the next reservations still go
    through (Redis once released it with HINCRBY "-0", which it refuses: the settle failed,
    and every later reservation of the tenant failed on the expired lease)."""
    assert await reserve(store, "free", [100, 0]) is None
    await store.settle(SCOPE, "free", [DAY, MONTH], [80, 0])
    assert await store.read([DAY, MONTH]) == [(80, 0), (0, 0)]
    assert await reserve(store, "crashed", [50, 0], until=NOW + 1) is None
    later = NOW + 5
    for lease in ("next", "after"):
        assert await store.reserve(SCOPE, lease, [DAY, MONTH], [10, 0], lease_until=later + 60,
                                   now=later) is None  # fmt: skip
    assert await store.read([DAY, MONTH]) == [(80, 20), (0, 0)]


async def test_concurrent_reservations_never_exceed_the_limit(store: QuotaStore) -> None:
    # More concurrent calls than the Redis connection pool holds: they wait, none fails.
    results = await asyncio.gather(*(reserve(store, f"r{i}", [30, 30]) for i in range(300)))
    held = sum(1 for r in results if r is None)
    assert held == 33  # 33 * 30 = 990 <= 1000 < 34 * 30
    assert await store.read([DAY]) == [(0, 990)]


async def test_charging_so_far_moves_reservation_to_used_and_settle_books_the_rest(
    store: QuotaStore,
) -> None:
    assert await reserve(store, "stream", [300, 300]) is None
    assert await store.charge(SCOPE, "stream", [DAY, MONTH], [100, 100])
    assert await store.read([DAY, MONTH]) == [(100, 200), (100, 200)]
    assert await store.charge(SCOPE, "stream", [DAY, MONTH], [150, 150])  # usage so far
    assert await store.read([DAY, MONTH]) == [(150, 150), (150, 150)]
    # A reservation that counts what was charged refuses a request the rest would not fit.
    refusal = await reserve(store, "next", [851, 851])
    assert refusal is not None
    assert (refusal.used, refusal.reserved) == (150, 150)
    await store.settle(SCOPE, "stream", [DAY, MONTH], [180, 180])  # books the rest, 30
    assert await store.read([DAY, MONTH]) == [(180, 0), (180, 0)]


async def test_a_charge_that_never_ran_is_booked_by_the_next_charge_or_the_settle_once(
    store: QuotaStore,
) -> None:
    """A checkpoint's charge whose call timed out without running (Redis never read it): the
    gateway cannot tell it from one that ran, and counts it booked. It sent the growth since
    the last charge, and those tokens were lost from the quota for good (1,002 booked of 1,205
    used). A charge now carries the usage so far: the next one, or the settle, books them."""
    assert await reserve(store, "stream", [300, 300]) is None
    assert await store.charge(SCOPE, "stream", [DAY, MONTH], [100, 100])
    # A charge of [180, 180] is lost on its way; the caller counts it booked.
    assert await store.charge(SCOPE, "stream", [DAY, MONTH], [250, 250], booked=[180, 180])
    assert await store.read([DAY, MONTH]) == [(250, 50), (250, 50)]
    await store.settle(SCOPE, "stream", [DAY, MONTH], [300, 300], booked=[250, 250])
    assert await store.read([DAY, MONTH]) == [(300, 0), (300, 0)]
    # The last charge lost: the settle books it.
    assert await reserve(store, "last", [100, 100]) is None
    assert await store.charge(SCOPE, "last", [DAY, MONTH], [20, 20])
    await store.settle(SCOPE, "last", [DAY, MONTH], [60, 60], booked=[40, 40])
    assert await store.read([DAY, MONTH]) == [(360, 0), (360, 0)]


async def test_a_charge_that_ran_but_whose_reply_was_lost_is_not_booked_twice(
    store: QuotaStore,
) -> None:
    """The same charge run twice (sent again, or the next checkpoint with nothing new), or an
    older one landing after a newer (a slow Redis caught up): each books nothing more."""
    assert await reserve(store, "stream", [300, 300]) is None
    assert await store.charge(SCOPE, "stream", [DAY, MONTH], [100, 100])
    assert await store.charge(SCOPE, "stream", [DAY, MONTH], [100, 100], booked=[100, 100])
    assert await store.charge(SCOPE, "stream", [DAY, MONTH], [150, 150], booked=[100, 100])
    assert await store.charge(SCOPE, "stream", [DAY, MONTH], [120, 120], booked=[100, 100])
    assert await store.read([DAY, MONTH]) == [(150, 150), (150, 150)]
    await store.settle(SCOPE, "stream", [DAY, MONTH], [170, 170], booked=[150, 150])
    assert await store.read([DAY, MONTH]) == [(170, 0), (170, 0)]


async def test_a_settle_sent_again_held_books_the_usage_beyond_what_charges_booked(
    store: QuotaStore,
) -> None:
    """A kept settle (stages/unbooked.py) carries the request's whole usage: applied on a held
    lease, it books what the lease's charges did not, whatever the first settle's caller
    thought they had."""
    assert await reserve(store, "stream", [300, 300]) is None
    assert await store.charge(SCOPE, "stream", [DAY, MONTH], [100, 100])
    assert await store.settle_held(SCOPE, "stream", [DAY, MONTH], [210, 210])
    assert not await store.settle_held(SCOPE, "stream", [DAY, MONTH], [210, 210])
    assert await store.read([DAY, MONTH]) == [(210, 0), (210, 0)]


async def test_charging_more_than_was_reserved_never_leaves_a_negative_reservation(
    store: QuotaStore,
) -> None:
    assert await reserve(store, "short", [100, 100]) is None
    assert await reserve(store, "other", [200, 200]) is None
    assert await store.charge(SCOPE, "short", [DAY, MONTH], [150, 150])
    # Only the charged lease's own share is released; the other request's stays held.
    assert await store.read([DAY, MONTH]) == [(150, 200), (150, 200)]
    assert await store.charge(SCOPE, "short", [DAY, MONTH], [170, 170])
    assert await store.read([DAY]) == [(170, 200)]
    await store.settle(SCOPE, "short", [DAY, MONTH], [170, 170])
    assert await store.read([DAY]) == [(170, 200)]


async def test_a_refund_on_a_counter_redis_lost_never_takes_it_below_zero(redis_url: str) -> None:
    """A stream's checkpoints booked more than its final usage (the gateway counted its input
    above the backend's `usage`), and Redis restarted (empty) meanwhile: settling gives back the
    difference on a counter that no longer holds it. It went to -20 used, and the tenant could
    then reserve 20 over its limit; it stays at 0."""
    store = RedisStore(redis_url)
    with redis.Redis.from_url(redis_url) as admin:
        admin.flushdb()
        assert await reserve(store, "stream", [300, 300]) is None
        assert await store.charge(SCOPE, "stream", [DAY, MONTH], [100, 100])
        admin.flushdb()  # the lease and what it booked went with it: `booked` is used
        await store.settle(SCOPE, "stream", [DAY, MONTH], [80, 80], booked=[100, 100])
        assert await store.read([DAY, MONTH]) == [(0, 0), (0, 0)]
        over = await reserve(store, "next", [1010, 1010])
    await store.aclose()
    assert over is not None
    assert (over.index, over.used, over.reserved) == (0, 0, 0)


@pytest.mark.parametrize("evicted", ["lease_holdings", "leases"])
async def test_a_reservation_whose_lease_redis_evicted_does_not_refuse_what_fits(
    redis_url: str, evicted: str
) -> None:
    """Under a maxmemory policy Redis evicted a running request's lease (its holdings, then it
    settled; or the lease set, then its gateway died) but kept the counter, which a /metrics
    scrape had just read. Nothing gave the 300 reserved back until the day's counter expired:
    the tenant was refused requests that fit. A reservation that would be refused first brings
    the counters down to what live leases hold (here another request's 100)."""
    store = RedisStore(redis_url)
    with redis.Redis.from_url(redis_url) as admin:
        admin.flushdb()
        assert await reserve(store, "running", [300, 300]) is None
        admin.delete(f"{SCOPE}:{evicted}")
        if evicted == "lease_holdings":
            await store.settle(SCOPE, "running", [DAY, MONTH], [100, 100])
        assert await reserve(store, "busy", [100, 100]) is None
        used = 100 if evicted == "lease_holdings" else 0
        fits = await reserve(store, "next", [900 - used, 900 - used])
        over = await reserve(store, "over", [1, 1])
        day = await store.read([DAY])
    await store.aclose()
    assert fits is None
    assert over is not None
    assert day == [(used, 1000 - used)]


async def test_what_a_crashed_request_charged_stays_used_when_its_lease_expires(
    store: QuotaStore,
) -> None:
    assert await reserve(store, "crashed", [400, 400], until=NOW + 1) is None
    assert await store.charge(SCOPE, "crashed", [DAY, MONTH], [120, 120])
    # The next reservation after the lease's end releases what it still held, not the use.
    later = NOW + 5
    assert await store.reserve(SCOPE, "next", [DAY, MONTH], [10, 10], lease_until=later + 60,
                               now=later) is None  # fmt: skip
    assert await store.read([DAY, MONTH]) == [(120, 10), (120, 10)]
    # Charging a lease that is gone still books the use (beyond what the caller counts booked),
    # and says the lease is gone.
    assert not await store.charge(SCOPE, "crashed", [DAY, MONTH], [125, 125], booked=[120, 120])
    assert await store.read([DAY]) == [(125, 10)]


async def test_redis_counters_expire_when_their_period_ends_whichever_call_made_them(
    redis_url: str,
) -> None:
    settled = Counter("tw:{acme}:q:usd:d:20261129", limit=1000, expires_at=2_000_000_100.5)
    charged = Counter("tw:{acme}:q:usd:m:202611", limit=1000, expires_at=2_000_000_200)
    store = RedisStore(redis_url)
    with redis.Redis.from_url(redis_url) as admin:
        admin.flushdb()
        assert await reserve(store, "r1", [300, 300]) is None
        await store.settle(SCOPE, "r1", [settled], [5])  # no reservation made these two
        assert await store.charge(SCOPE, "r2", [charged], [7]) is False
        assert await reserve(store, "r3", [100, 100]) is None  # the counters exist by now
        await store.settle(SCOPE, "r3", [DAY, MONTH, settled], [50, 60, 5])
        assert await store.charge(SCOPE, "r4", [charged], [7]) is False
        assert await store.read([DAY, MONTH, settled, charged]) == [
            (50, 0), (60, 0), (10, 0), (14, 0),
        ]  # fmt: skip
        assert [admin.expiretime(c.key) for c in (DAY, MONTH, settled, charged)] == [
            2_000_000_000, 2_000_000_000, 2_000_000_101, 2_000_000_200,
        ]  # fmt: skip
    await store.aclose()


async def test_a_reservation_of_fifteen_digits_is_given_back_to_the_unit(store: QuotaStore) -> None:
    """Redis kept what a lease holds as JSON numbers, which its Lua cjson writes with 14
    significant digits: a reservation of 123,456,789,012,349 (a USD quota's nano-USD, or
    tokens) was written as 1.2345678901235e+14, and released as 123,456,789,012,350, one more
    than was reserved, taking it from what other requests held. Amounts are now kept exact."""
    huge = Counter("tw:{acme}:q:usd:m:202611", limit=2**53 - 1, expires_at=2_000_000_000)
    counters, big = [huge], 123_456_789_012_349

    async def hold(lease: str, amount: int) -> None:
        held = await store.reserve(SCOPE, lease, counters, [amount], lease_until=NOW + 60, now=NOW)
        assert held is None

    await hold("small", 1000)
    await hold("big", big)
    await store.settle(SCOPE, "big", counters, [7])
    assert await store.read(counters) == [(7, 1000)]
    await hold("charged", big)
    await store.charge(SCOPE, "charged", counters, [3])
    await store.settle(SCOPE, "charged", counters, [3])
    await hold("expired", big + 2)
    assert await store.read(counters) == [(10, 1000 + big + 2)]
    await store.reserve(SCOPE, "next", counters, [1], lease_until=NOW + 60, now=NOW + 120)
    assert await store.read(counters) == [(10, 1)]  # "small" and "expired" expired, released
