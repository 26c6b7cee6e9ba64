"""The stores' one Redis link: the calls of one turn of the event loop go in one script call (one
per hash slot on a cluster), each with its own outcome, and a failing one fails alone."""

from __future__ import annotations

import asyncio

import pytest
import redis

from proxy.storage import Counter, RedisStorage, StorageError
from proxy.storage.cache import CacheEntry
from proxy.storage.joint import Admit, Reserve
from proxy.storage.limits import Bucket, BucketState, SlotPool
from proxy.storage.redis.conn import connect

pytestmark = pytest.mark.anyio

NOW = 1_800_000_000.0
ACME, GLOBEX = "tw:{acme}", "tw:{globex}"
DAY = Counter("tw:{acme}:q:tokens:d:20261129", limit=1000, expires_at=2_000_000_000)
MONTH = Counter("tw:{acme}:q:tokens:m:202611", limit=5000, expires_at=2_000_000_000)
OTHER_DAY = Counter("tw:{globex}:q:tokens:d:20261129", limit=1000, expires_at=2_000_000_000)
POOL = SlotPool("tw:{acme}:rl:slots", size=1)
TPM = Bucket("tw:{acme}:rl:tpm", capacity=1200, refill_per_s=20.0)


@pytest.fixture(params=["redis", "redis-unix", "redis-sentinel", "redis-cluster"])
def any_redis(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{request.param.replace('-', '_')}_url"))


async def test_calls_made_together_are_all_applied_each_with_its_outcome(any_redis: str) -> None:
    storage = RedisStorage(any_redis, timeout_s=10.0)
    quotas, limits, cache = storage.quotas, storage.limits, storage.cache
    assert await quotas.reserve(ACME, "r1", [DAY], [300], lease_until=NOW + 60, now=NOW) is None
    assert (
        await limits.admit(ACME, [], [], [POOL], lease_id="r1", lease_until=NOW + 60, now=NOW)
    ).admitted
    calls = [
        quotas.settle(ACME, "r1", [DAY], [120]),
        quotas.settle(GLOBEX, "r2", [OTHER_DAY], [7]),
        limits.release(ACME, [POOL], lease_id="r1"),
        limits.settle(ACME, TPM, 200, now=NOW),
        cache.put(CacheEntry("acme", "k", b"answer", NOW, ttl_s=60.0, max_entries=10)),
        quotas.charge(ACME, "gone", [DAY], [5]),
    ]
    outcomes = await asyncio.gather(*calls)
    assert outcomes == [None, None, None, None, None, False]  # `charge`: no such lease
    assert await quotas.read([DAY, OTHER_DAY]) == [(125, 0), (7, 0)]
    assert await limits.peek(ACME, [TPM], now=NOW) == (BucketState(1200, 1000, 10.0),)
    assert await cache.get("acme", "k", now=NOW) == b"answer"
    assert (
        await limits.admit(ACME, [], [], [POOL], lease_id="r3", lease_until=NOW + 60, now=NOW)
    ).admitted
    await storage.aclose()


async def test_calls_made_in_one_turn_are_one_script_call(redis_url: str) -> None:
    storage = RedisStorage(redis_url)
    await storage.quotas.settle(ACME, "warm", [DAY], [0])  # the server learns the script
    with redis.Redis.from_url(redis_url) as admin:
        admin.config_resetstat()
        await asyncio.gather(
            storage.quotas.settle(ACME, "r1", [DAY], [10]),
            storage.quotas.settle(GLOBEX, "r2", [OTHER_DAY], [20]),
            storage.limits.release(ACME, [POOL], lease_id="r1"),
        )
        stats = admin.info("commandstats")
    assert stats["cmdstat_evalsha"]["calls"] == 1
    await storage.aclose()


@pytest.mark.parametrize("which", ["redis", "redis-unix"])
async def test_a_turns_calls_reach_a_server_that_forgot_the_script(
    which: str, request: pytest.FixtureRequest
) -> None:
    """A server that answers NOSCRIPT (restarted, or SCRIPT FLUSH) gets the script loaded by
    the turn's one call that met it, and every operation of that call is applied once."""
    url = str(request.getfixturevalue(f"{which.replace('-', '_')}_url"))
    storage = RedisStorage(url, timeout_s=10.0)
    await storage.quotas.settle(ACME, "warm", [DAY], [0])  # connected, the script known
    admin = connect(url, timeout_s=10.0, max_connections=2)
    await admin.script_flush()
    await admin.config_resetstat()
    await asyncio.gather(
        storage.quotas.settle(ACME, "r1", [DAY], [10]),
        storage.quotas.settle(GLOBEX, "r2", [OTHER_DAY], [20]),
    )
    assert await storage.quotas.read([DAY, OTHER_DAY]) == [(10, 0), (20, 0)]
    stats = await admin.info("commandstats")
    assert stats["cmdstat_eval"]["calls"] == 1  # loaded once, each settle applied once
    await admin.aclose()
    await storage.aclose()


async def test_a_failing_call_fails_alone(any_redis: str) -> None:
    storage = RedisStorage(any_redis, timeout_s=10.0)
    admin = connect(any_redis, timeout_s=10.0, max_connections=2)
    await admin.set(MONTH.key, "not a hash")
    await admin.aclose()
    broken = storage.quotas.settle(ACME, "r1", [MONTH], [10])
    fine = storage.quotas.settle(ACME, "r1", [DAY], [10])
    with pytest.raises(StorageError, match="WRONGTYPE"):
        await broken
    await fine
    assert await storage.quotas.read([DAY]) == [(10, 0)]
    await storage.aclose()


@pytest.mark.parametrize("connected", [False, True], ids=["unconnected", "connected"])
async def test_closing_sends_what_is_pending_first(any_redis: str, connected: bool) -> None:
    """A settlement queued in the turn that closes the link still counts, whether the link
    must connect first or writes it at once on its open connection."""
    storage = RedisStorage(any_redis, timeout_s=10.0)
    if connected:
        await storage.quotas.settle(ACME, "warm", [DAY], [0])
    settled = storage.quotas.settle(ACME, "r1", [DAY], [42])
    await storage.aclose()
    await settled
    again = RedisStorage(any_redis, timeout_s=10.0)
    assert await again.quotas.read([DAY]) == [(42, 0)]
    await again.aclose()


async def test_a_gate_across_hash_slots_stops_at_the_first_refusal(redis_cluster_url: str) -> None:
    storage = RedisStorage(redis_cluster_url, timeout_s=10.0)
    refused = Reserve(ACME, "r1", [DAY], [5000], lease_until=NOW + 60, now=NOW)
    later = Admit(GLOBEX, [], [], [SlotPool("tw:{globex}:rl:slots", 1)], lease_id="r1",
                  lease_until=NOW + 60, now=NOW)  # fmt: skip
    await storage.admit([refused, later])
    assert refused.refused
    assert not later.taken
    await storage.aclose()


async def test_a_turns_calls_with_no_answer_in_time_fail_with_a_timeout(redis_url: str) -> None:
    """Calls written at once on the open connection are bounded by the client's timeout: with
    Redis holding every write (CLIENT PAUSE), each fails with StorageTimeout, none waits on."""
    storage = RedisStorage(redis_url, timeout_s=1.0)
    await storage.quotas.settle(ACME, "warm", [DAY], [0])  # connected, the script known
    with redis.Redis.from_url(redis_url) as admin:
        admin.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")
        try:
            calls = [
                storage.quotas.settle(ACME, "r1", [DAY], [10]),
                storage.limits.release(ACME, [POOL], lease_id="r1"),
            ]
            outcomes = await asyncio.wait_for(
                asyncio.gather(*calls, return_exceptions=True), timeout=8.0
            )
        finally:
            admin.execute_command("CLIENT", "UNPAUSE")
    assert [type(outcome).__name__ for outcome in outcomes] == ["StorageTimeout"] * 2
    await storage.aclose()


@pytest.mark.parametrize("limit", [2**63 + 1, 2**64 + 5], ids=["past-int64", "past-uint64"])
async def test_a_limit_too_large_for_redis_integers_still_holds_every_reservation(
    limit: int, redis_url: str
) -> None:
    """Lua's numbers are doubles: a limit past int64 arrives as the double it becomes there,
    never wrapped to a negative one that refuses everything, nor failing to send."""
    storage = RedisStorage(redis_url, timeout_s=10.0)
    huge = Counter("tw:{acme}:q:usd:d:20261129", limit=limit, expires_at=2_000_000_000)
    assert (
        await storage.quotas.reserve(ACME, "r1", [huge], [300], lease_until=NOW + 60, now=NOW)
        is None
    )
    await storage.quotas.settle(ACME, "r1", [huge], [120])
    assert await storage.quotas.read([huge]) == [(120, 0)]
    await storage.aclose()


async def test_bytes_and_strings_of_any_kind_are_stored_as_sent(any_redis: str) -> None:
    """Arguments travel as one packed array: a value that is not UTF-8, and text whose UTF-8
    bytes look like the packing's own markers, come back byte for byte."""
    storage = RedisStorage(any_redis, timeout_s=10.0)
    value = b"\xcf\x80\x00\xff\xc4\x01" + "Ϗϴ ответ".encode()
    await storage.cache.put(CacheEntry("acme", "Ϗϴ-ключ", value, NOW, ttl_s=60.0, max_entries=10))
    assert await storage.cache.get("acme", "Ϗϴ-ключ", now=NOW) == value
    assert await storage.cache.get("acme", "Ϗϴ", now=NOW) is None
    await storage.aclose()
