"""Quota settles storage did not take, kept and sent again, on a real Redis of their own: booked
once when it takes writes, never twice when the failed call may have run, bounded, and sent
once more at shutdown."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager

import pytest
import redis

from proxy.stages import unbooked as unbooked_module
from proxy.stages.unbooked import Unbooked, UnbookedSettle
from proxy.storage import Counter, RedisStore
from proxy.storage.base import StorageRefused, StorageTimeout
from tests.redis_server import RedisProcess

pytestmark = pytest.mark.anyio

SCOPE = "tw:{acme}"
# The day the request was admitted in: booked there however late the settle gets through.
ADMITTED_DAY = Counter("tw:{acme}:q:tokens:d:20261206", limit=1000, expires_at=2_000_000_000)
NOW = time.time()


@pytest.fixture
async def redis_server() -> AsyncIterator[RedisProcess]:
    server = RedisProcess()
    server.start()
    yield server
    server.close()


@pytest.fixture
async def store(redis_server: RedisProcess) -> AsyncIterator[RedisStore]:
    opened = RedisStore(redis_server.url, timeout_s=5.0)
    yield opened
    await opened.aclose()


@contextmanager
def _read_only(url: str) -> Iterator[None]:
    with redis.Redis.from_url(url) as admin:
        admin.execute_command("REPLICAOF", "127.0.0.1", "1")  # a primary it never reaches
        try:
            yield
        finally:
            admin.execute_command("REPLICAOF", "NO", "ONE")


async def _reserve(store: RedisStore, lease: str, amount: int) -> None:
    refused = await store.reserve(
        SCOPE, lease, [ADMITTED_DAY], [amount], lease_until=NOW + 60, now=NOW
    )
    assert refused is None


def _settle(lease: str, used: int) -> UnbookedSettle:
    return UnbookedSettle("acme", SCOPE, lease, [ADMITTED_DAY], [used])


async def _until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s} s"
        await asyncio.sleep(0.05)


async def test_a_settle_redis_refused_is_booked_once_when_it_takes_writes(
    store: RedisStore, redis_server: RedisProcess
) -> None:
    unbooked = Unbooked(store, time.time)
    await _reserve(store, "r1", 300)
    with _read_only(redis_server.url):
        with pytest.raises(StorageRefused):
            await store.settle(SCOPE, "r1", [ADMITTED_DAY], [120])
        unbooked.keep(_settle("r1", 120), StorageRefused("redis: READONLY"))
        await asyncio.sleep(0.6)  # sent again at least once, and refused again
        assert unbooked.stats()["pending"] == 1
    assert await store.read([ADMITTED_DAY]) == [(0, 300)]

    async def booked() -> bool:
        return await store.read([ADMITTED_DAY]) == [(120, 0)]

    await _until(booked, "the kept settle booked")
    await asyncio.sleep(0.6)  # nothing left to send: it stays booked once
    assert await store.read([ADMITTED_DAY]) == [(120, 0)]
    assert unbooked.stats() == {
        "pending": 0, "booked_late": 1, "settled_before": 0, "uncertain": 0, "dropped": 0,
    }  # fmt: skip
    await unbooked.aclose()


async def test_a_settle_that_may_have_run_is_booked_exactly_once(store: RedisStore) -> None:
    """A timed-out settle may have run (here it did: r1) or not (r2): each is sent again only
    where its lease is still held, so r1 counts once, and r2 once too (before, r2 only had its
    lease released: its use never reached the quota)."""
    unbooked = Unbooked(store, time.time)
    await _reserve(store, "r1", 300)
    await _reserve(store, "r2", 200)
    await store.settle(SCOPE, "r1", [ADMITTED_DAY], [120])  # it ran; its answer was lost
    unbooked.keep(_settle("r1", 120), StorageTimeout("redis: Timeout reading"))
    unbooked.keep(_settle("r2", 50), StorageTimeout("redis: Timeout reading"))

    async def sent() -> bool:
        return unbooked.stats()["pending"] == 0

    await _until(sent, "the kept settles sent")
    assert await store.read([ADMITTED_DAY]) == [(170, 0)]
    assert unbooked.stats() == {
        "pending": 0, "booked_late": 1, "settled_before": 1, "uncertain": 2, "dropped": 0,
    }  # fmt: skip
    await unbooked.aclose()


async def test_a_settle_sent_again_waits_for_the_first_copy_and_applies_once(
    store: RedisStore,
) -> None:
    """A first copy still on its way when the settle is kept (here it lands 1 s later): the
    copy sent again waits for it, finds the lease released, and books nothing more."""
    unbooked = Unbooked(store, time.time)
    await _reserve(store, "r1", 300)
    unbooked.keep(_settle("r1", 120), StorageTimeout("redis: Timeout reading"))
    await asyncio.sleep(1.0)
    await store.settle(SCOPE, "r1", [ADMITTED_DAY], [120])  # the first copy lands late

    async def sent() -> bool:
        return unbooked.stats()["pending"] == 0

    await _until(sent, "the kept settle sent")
    assert await store.read([ADMITTED_DAY]) == [(120, 0)]
    assert unbooked.stats()["settled_before"] == 1
    await unbooked.aclose()


async def test_kept_settles_are_bounded_per_tenant(
    store: RedisStore, redis_server: RedisProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(unbooked_module, "MAX_PER_TENANT", 2)
    unbooked = Unbooked(store, time.time)
    with _read_only(redis_server.url):
        for lease in ("r1", "r2", "r3"):
            unbooked.keep(_settle(lease, 10), StorageRefused("redis: READONLY"))
        assert (unbooked.stats()["pending"], unbooked.stats()["dropped"]) == (2, 1)
    await unbooked.aclose()
    assert await store.read([ADMITTED_DAY]) == [(20, 0)]  # the two newest


async def test_shutdown_sends_what_is_kept_at_once_and_logs_what_storage_still_refuses(
    store: RedisStore, redis_server: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    unbooked = Unbooked(store, time.time)
    with _read_only(redis_server.url):
        unbooked.keep(_settle("r1", 10), StorageRefused("redis: READONLY"))
        await asyncio.sleep(2.0)  # refused a few times: the next send is seconds away
    started = time.monotonic()
    await unbooked.aclose()
    assert time.monotonic() - started < 1.5  # not after the back-off
    assert await store.read([ADMITTED_DAY]) == [(10, 0)]

    refusing = Unbooked(store, time.time)
    with _read_only(redis_server.url), caplog.at_level(logging.ERROR, "tokenweir.budget"):
        refusing.keep(_settle("r2", 10), StorageRefused("redis: READONLY"))
        await refusing.aclose()
    assert refusing.stats()["dropped"] == 1
    assert "1 quota settles could not be booked" in caplog.text
    refusing.keep(_settle("r3", 10), StorageRefused("redis: READONLY"))  # ended after the last
    assert (refusing.stats()["pending"], refusing.stats()["dropped"]) == (0, 2)
    assert await store.read([ADMITTED_DAY]) == [(10, 0)]


async def test_a_shutdown_cut_short_while_redis_hangs_counts_what_it_did_not_book(
    redis_server: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM while a kept settle is being sent to a hung Redis, the shutdown step cut at its
    bound: the settle was neither booked nor counted (`dropped` 0, no error logged), as if
    nothing were lost. Now it is counted `dropped` and logged."""
    store = RedisStore(redis_server.url, timeout_s=1.0)
    unbooked = Unbooked(store, time.time)
    await _reserve(store, "r1", 300)
    redis_server.pause()
    try:
        unbooked.keep(_settle("r1", 120), StorageRefused("redis: READONLY"))
        await asyncio.sleep(0.5)  # sent again at 0.25 s: Redis holds it unanswered
        with caplog.at_level(logging.ERROR, "tokenweir.budget"), pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):  # as services.py bounds a step, here shorter
                await unbooked.aclose()
    finally:
        redis_server.resume()
    assert (unbooked.stats()["pending"], unbooked.stats()["dropped"]) == (0, 1)
    assert "1 quota settles could not be booked" in caplog.text
    await store.aclose()
