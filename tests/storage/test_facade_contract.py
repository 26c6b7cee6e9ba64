"""One contract, every storage: a request's admission steps taken together, in order, stopping
after the first that refuses or fails, each with the outcome its own store call would have."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import pytest
import redis

from proxy.storage import Counter, RedisStorage, Storage, StorageError, open_storage
from proxy.storage.cache import CacheEntry
from proxy.storage.joint import Admit, Lookup, Reserve
from proxy.storage.limits import Bucket, BucketState, SlotPool

pytestmark = pytest.mark.anyio

SCOPE = "tw:{acme}"
DAY = Counter("tw:{acme}:q:tokens:d:20261129", limit=1000, expires_at=2_000_000_000)
RPM = Bucket("tw:{acme}:rl:rpm", capacity=60, refill_per_s=1.0)
POOL = SlotPool("tw:{acme}:rl:slots", size=1)
NOW = 1_800_000_000.0


@pytest.fixture
async def storage(storage_url: str) -> AsyncIterator[Storage]:
    # A generous timeout, as the other contract suites have: they check decisions, not speed.
    chosen = (
        open_storage("memory")
        if storage_url == "memory"
        else RedisStorage(storage_url, timeout_s=10.0)
    )
    yield chosen
    for store in (chosen.quotas, chosen.limits, chosen.cache):
        await store.aclose()
    await chosen.aclose()


def reserve(amount: int, lease: str = "r1") -> Reserve:
    return Reserve(SCOPE, lease, [DAY], [amount], lease_until=NOW + 60, now=NOW)


def admit(lease: str = "r1", cost: int = 1) -> Admit:
    return Admit(SCOPE, [RPM], [cost], [POOL], lease_id=lease, lease_until=NOW + 60, now=NOW)


async def stored(storage: Storage, key: str) -> None:
    entry = CacheEntry("acme", key, b"answer", NOW, ttl_s=3600.0, max_entries=10)
    await storage.cache.put(entry)


async def slot_taken(storage: Storage, lease: str) -> bool:
    one = await storage.limits.admit(
        SCOPE, [], [], [POOL], lease_id=lease, lease_until=NOW + 60, now=NOW
    )
    return one.admitted


async def test_steps_that_all_pass_are_all_taken_with_their_answers(storage: Storage) -> None:
    await stored(storage, "k")
    steps = (reserve(300), admit(), Lookup("acme", "k", now=NOW))
    await storage.admit(steps)
    assert [step.taken for step in steps] == [True, True, True]
    assert steps[0].answer is None  # held
    assert steps[1].answer.admitted
    assert steps[2].answer == b"answer"
    assert await storage.quotas.read([DAY]) == [(0, 300)]
    assert await storage.limits.peek(SCOPE, [RPM], now=NOW) == (BucketState(60, 59, 1.0),)


async def test_a_refusal_stops_the_steps_after_it_and_keeps_what_came_before(
    storage: Storage,
) -> None:
    await stored(storage, "k")
    assert await slot_taken(storage, "other")
    steps = (reserve(300), admit(), Lookup("acme", "k", now=NOW))
    await storage.admit(steps)
    assert [step.taken for step in steps] == [True, True, False]
    assert steps[1].refused
    assert steps[1].answer.refused == 1
    # The reservation before the refusal holds, as its own call would have left it; the bucket
    # of the refused admission is not charged.
    assert await storage.quotas.read([DAY]) == [(0, 300)]
    assert await storage.limits.peek(SCOPE, [RPM], now=NOW) == (BucketState(60, 60, 0.0),)


async def test_a_refused_reservation_takes_nothing_after_it(storage: Storage) -> None:
    steps = (reserve(5000), admit(), Lookup("acme", "k", now=NOW))
    await storage.admit(steps)
    assert [step.taken for step in steps] == [True, False, False]
    refusal = steps[0].answer
    assert refusal is not None
    assert (refusal.index, refusal.used, refusal.reserved) == (0, 0, 0)
    assert await storage.limits.peek(SCOPE, [RPM], now=NOW) == (BucketState(60, 60, 0.0),)
    assert await slot_taken(storage, "next")  # the admission was not taken: the pool is free


async def test_a_step_not_taken_can_be_taken_on_its_own_later(storage: Storage) -> None:
    steps = (reserve(5000), admit())
    await storage.admit(steps)
    await steps[1].run(storage.limits)
    assert steps[1].taken
    assert steps[1].answer.admitted


async def test_undoing_a_step_gives_back_what_it_took(storage: Storage) -> None:
    steps = (reserve(300), admit())
    await storage.admit(steps)
    for step in steps:
        undo = step.undo_in(storage)
        assert undo is not None
        release, within_s = undo
        assert within_s == 60
        await release()
        await release()  # safe to repeat
    assert await storage.quotas.read([DAY]) == [(0, 0)]
    assert await slot_taken(storage, "next")


async def test_redis_takes_an_admission_in_one_call(redis_url: str) -> None:
    storage = RedisStorage(redis_url)
    await storage.cache.get("acme", "warm", now=NOW)  # the server learns the script
    with redis.Redis.from_url(redis_url) as admin:
        admin.config_resetstat()
        await storage.admit((reserve(300), admit(), Lookup("acme", "k", now=NOW)))
        assert _script_calls(admin) == 1
    await storage.aclose()


async def test_an_unreachable_redis_fails_every_step_with_its_stores_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    storage = RedisStorage(f"redis://127.0.0.1:{port}/0", timeout_s=0.5)
    steps = (reserve(300), admit(), Lookup("acme", "k", now=NOW))
    await storage.admit(steps)
    assert all(isinstance(step.error, StorageError) for step in steps)
    assert [str(step.error).split(":")[0] for step in steps] == ["redis", "redis", "cache storage"]
    with pytest.raises(StorageError):
        steps[0].answer  # noqa: B018 - the answer raises the step's error
    await storage.aclose()


def _script_calls(admin: redis.Redis) -> int:
    stats = admin.info("commandstats")
    return sum(
        int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("eval", "evalsha")
    )
