"""One contract, every storage: token buckets and slot leases, admitted all-or-nothing."""

from __future__ import annotations

import asyncio
import math
import socket
from collections.abc import AsyncIterator, Sequence

import pytest
import redis

from proxy.storage.base import StorageError
from proxy.storage.limits import Admission, Bucket, BucketState, LimitStore, SlotPool
from proxy.storage.memory.limits import MemoryLimitStore
from proxy.storage.redis.limits import RedisLimitStore

SCOPE = "tw:{acme}"
RPM = Bucket("tw:{acme}:rl:rpm", capacity=60, refill_per_s=1.0)
TPM = Bucket("tw:{acme}:rl:tpm", capacity=1200, refill_per_s=20.0)
POOL = SlotPool("tw:{acme}:rl:slots", size=2)
NOW = 1_800_000_000.0
LEASE_S = 60.0


@pytest.fixture
async def store(storage_url: str) -> AsyncIterator[LimitStore]:
    chosen: LimitStore
    # A generous storage timeout: these tests check what the store decides, not how fast (see
    # test_quota_contract's store).
    chosen = (
        MemoryLimitStore()
        if storage_url == "memory"
        else RedisLimitStore(storage_url, timeout_s=10.0)
    )
    yield chosen
    await chosen.aclose()


pytestmark = pytest.mark.anyio


async def admit(
    store: LimitStore,
    costs: Sequence[int],
    *,
    at: float = NOW,
    buckets: Sequence[Bucket] = (RPM, TPM),
    slots: Sequence[SlotPool] = (),
    lease: str = "r1",
    lease_s: float = LEASE_S,
) -> Admission:
    return await store.admit(
        SCOPE, buckets, costs, slots, lease_id=lease, lease_until=at + lease_s, now=at
    )


async def test_a_burst_up_to_capacity_then_a_refusal_saying_when_to_retry(
    store: LimitStore,
) -> None:
    for _ in range(3):
        assert (await admit(store, [1, 400])).admitted
    refused = await admit(store, [1, 100])
    assert (refused.admitted, refused.refused, refused.retry_after_s) == (False, 1, 5.0)
    assert not refused.never
    assert (await admit(store, [1, 100], at=NOW + 4.9)).refused == 1
    assert (await admit(store, [1, 100], at=NOW + 5)).admitted


async def test_buckets_refill_continuously_but_never_above_capacity(store: LimitStore) -> None:
    assert (await admit(store, [60, 1200])).admitted
    assert await store.peek(SCOPE, [RPM, TPM], now=NOW + 15) == (
        BucketState(60, 15, 45.0),
        BucketState(1200, 300, 45.0),
    )
    assert await store.peek(SCOPE, [RPM], now=NOW + 3600) == (BucketState(60, 60, 0.0),)
    refused = await admit(store, [61, 0], at=NOW + 3600)
    assert (refused.refused, refused.never) == (0, True)


async def test_a_refusal_by_any_bucket_charges_no_bucket(store: LimitStore) -> None:
    assert (await admit(store, [1, 1000])).admitted
    refused = await admit(store, [1, 300])
    assert (refused.refused, refused.retry_after_s) == (1, 5.0)
    assert refused.buckets == (BucketState(60, 59, 1.0), BucketState(1200, 200, 50.0))
    assert await store.peek(SCOPE, [RPM, TPM], now=NOW) == refused.buckets


async def test_a_request_larger_than_a_limit_can_never_be_admitted(store: LimitStore) -> None:
    refused = await admit(store, [1, 1201])
    assert (refused.admitted, refused.refused, refused.retry_after_s) == (False, 1, math.inf)
    assert refused.never
    assert await store.peek(SCOPE, [RPM, TPM], now=NOW) == (
        BucketState(60, 60, 0.0),
        BucketState(1200, 1200, 0.0),
    )


async def test_the_impossible_limit_is_named_even_when_an_earlier_one_refuses(
    store: LimitStore,
) -> None:
    assert (await admit(store, [60, 0])).admitted
    refused = await admit(store, [1, 5000])
    assert (refused.refused, refused.never) == (1, True)


async def test_the_wait_is_the_longest_of_the_refusing_buckets(store: LimitStore) -> None:
    assert (await admit(store, [58, 1200])).admitted
    refused = await admit(store, [4, 100])
    assert (refused.refused, refused.retry_after_s) == (0, 5.0)
    assert (await admit(store, [4, 100], at=NOW + 5)).admitted


async def test_settle_refunds_the_unused_part_up_to_capacity(store: LimitStore) -> None:
    assert (await admit(store, [1, 1000])).admitted
    await store.settle(SCOPE, TPM, -700, now=NOW)
    assert await store.peek(SCOPE, [TPM], now=NOW) == (BucketState(1200, 900, 15.0),)
    await store.settle(SCOPE, TPM, -5000, now=NOW)
    assert await store.peek(SCOPE, [TPM], now=NOW) == (BucketState(1200, 1200, 0.0),)


async def test_settle_charges_more_and_a_debt_makes_later_requests_wait(
    store: LimitStore,
) -> None:
    assert (await admit(store, [1, 1000])).admitted
    await store.settle(SCOPE, TPM, 600, now=NOW + 1)  # 220 after refill, then -380
    assert await store.peek(SCOPE, [TPM], now=NOW + 1) == (BucketState(1200, 0, 79.0),)
    refused = await admit(store, [1, 20], at=NOW + 1)
    assert (refused.refused, refused.retry_after_s) == (1, 20.0)  # 400 tokens at 20/s
    assert (await admit(store, [1, 20], at=NOW + 20)).refused == 1
    assert (await admit(store, [1, 20], at=NOW + 21)).admitted


async def test_admission_reports_what_the_headers_need(store: LimitStore) -> None:
    first = await admit(store, [1, 300])
    assert first == Admission(
        True, None, 0.0, (BucketState(60, 59, 1.0), BucketState(1200, 900, 15.0))
    )
    later = await admit(store, [1, 150], at=NOW + 2.5)
    assert later.buckets == (BucketState(60, 59, 1.0), BucketState(1200, 800, 20.0))


async def test_a_full_pool_refuses_and_a_release_frees_a_slot(store: LimitStore) -> None:
    assert (await admit(store, [1, 1], slots=[POOL], lease="a")).admitted
    assert (await admit(store, [1, 1], slots=[POOL], lease="b")).admitted
    refused = await admit(store, [1, 1], slots=[POOL], lease="c")
    assert (refused.refused, refused.retry_after_s, refused.never) == (2, 1.0, False)
    assert refused.buckets[0].remaining == 58  # nothing charged for the refused request
    await store.release(SCOPE, [POOL], lease_id="a")
    await store.release(SCOPE, [POOL], lease_id="never-held")
    assert (await admit(store, [1, 1], slots=[POOL], lease="c")).admitted


async def test_a_crashed_replicas_slots_are_purged_by_the_next_admission(
    store: LimitStore,
) -> None:
    other = SlotPool("tw:{acme}:rl:model:m:slots", size=1)
    assert (await admit(store, [1, 1], slots=[POOL, other], lease="a", lease_s=10)).admitted
    assert (await admit(store, [1, 1], slots=[POOL], lease="b", lease_s=100)).admitted
    assert (await admit(store, [1, 1], slots=[POOL], lease="c", at=NOW + 9.9)).refused == 2
    assert (await admit(store, [1, 1], slots=[POOL, other], lease="c", at=NOW + 10)).admitted
    assert not await store.renew(SCOPE, [POOL], lease_id="a", lease_until=NOW + 200)


async def test_held_counts_the_live_leases_and_takes_none(store: LimitStore) -> None:
    """What every replica holds of a pool, read by one that admitted nothing lately."""
    assert await store.held(SCOPE, [POOL], now=NOW) == (0,)
    assert (await admit(store, [1, 1], slots=[POOL], lease="a", lease_s=10)).admitted
    assert (await admit(store, [1, 1], slots=[POOL], lease="b", lease_s=100)).admitted
    assert await store.held(SCOPE, [POOL], now=NOW + 9.5) == (2,)
    assert await store.held(SCOPE, [POOL], now=NOW + 10) == (1,)  # a's lease has expired
    assert (await admit(store, [1, 1], slots=[POOL], lease="c", at=NOW + 10)).admitted


async def test_renew_keeps_a_lease_alive(store: LimitStore) -> None:
    assert (await admit(store, [1, 1], slots=[POOL], lease="a", lease_s=10)).admitted
    assert await store.renew(SCOPE, [POOL], lease_id="a", lease_until=NOW + 100)
    assert (await admit(store, [1, 1], slots=[POOL], lease="b", at=NOW + 50)).admitted
    assert (await admit(store, [1, 1], slots=[POOL], lease="c", at=NOW + 50)).refused == 2
    assert not await store.renew(SCOPE, [POOL], lease_id="never-held", lease_until=NOW + 100)


async def test_a_pool_of_size_zero_never_admits(store: LimitStore) -> None:
    closed = SlotPool("tw:{acme}:rl:closed", size=0)
    refused = await admit(store, [1, 1], slots=[POOL, closed])
    assert (refused.refused, refused.never) == (3, True)


async def test_concurrent_admissions_never_exceed_a_pool(store: LimitStore) -> None:
    pool = SlotPool("tw:{acme}:rl:slots", size=5)
    results = await asyncio.gather(
        *(admit(store, [0, 0], slots=[pool], lease=f"r{i}") for i in range(200))
    )
    assert sum(r.admitted for r in results) == 5
    assert {r.refused for r in results if not r.admitted} == {2}


async def test_concurrent_admissions_never_exceed_a_bucket(store: LimitStore) -> None:
    bucket = Bucket("tw:{acme}:rl:rpm:50", capacity=50, refill_per_s=50 / 60)
    results = await asyncio.gather(
        *(admit(store, [1], buckets=[bucket], lease=f"r{i}") for i in range(200))
    )
    assert sum(r.admitted for r in results) == 50
    assert await store.peek(SCOPE, [bucket], now=NOW) == (BucketState(50, 0, 60.0),)


async def test_keys_outside_the_scope_are_refused(store: LimitStore) -> None:
    stranger = Bucket("tw:{other}:rl:rpm", capacity=60, refill_per_s=1.0)
    with pytest.raises(ValueError, match="outside scope"):
        await admit(store, [1], buckets=[stranger])


async def test_a_replica_whose_clock_lags_neither_refills_nor_rewinds(store: LimitStore) -> None:
    assert (await admit(store, [30, 0])).admitted
    assert (await admit(store, [10, 0], at=NOW - 5)).admitted
    assert await store.peek(SCOPE, [RPM], now=NOW - 5) == (BucketState(60, 20, 40.0),)
    assert await store.peek(SCOPE, [RPM], now=NOW + 1) == (BucketState(60, 21, 39.0),)


async def test_redis_keys_live_until_the_bucket_is_full_or_the_last_lease_ends(
    redis_url: str,
) -> None:
    store = RedisLimitStore(redis_url)
    with redis.Redis.from_url(redis_url) as admin:
        admin.flushdb()
        assert (await admit(store, [10, 0], slots=[POOL], lease_s=30)).admitted
        assert admin.ttl(RPM.key) == 11  # 10 tokens at 1/s, plus a second
        assert not admin.exists(TPM.key)  # a full bucket is no key at all
        assert admin.ttl(POOL.key) == 31
        assert await store.renew(SCOPE, [POOL], lease_id="r1", lease_until=NOW + 130)
        assert admin.ttl(POOL.key) == 131
        await store.release(SCOPE, [POOL], lease_id="r1")
        await store.settle(SCOPE, RPM, -10, now=NOW)
        assert admin.keys("*") == []
    await store.aclose()


async def test_redis_failures_become_storage_errors() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = RedisLimitStore(f"redis://127.0.0.1:{port}/0", timeout_s=0.5)
    with pytest.raises(StorageError, match="redis"):
        await admit(store, [1, 1])
    await store.aclose()
