"""The runtime keys' local mirror (proxy/keys/runtime.py): on shared (Redis) storage it polls
the version and sees another replica's changes; on `memory` storage nothing else can change the
keys, so nothing polls, and this process's own changes hold at once."""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections.abc import Callable

import pytest

from proxy.clock import SystemClock
from proxy.keys.record import KeyAllowance
from proxy.keys.runtime import RuntimeKeys
from proxy.storage.keys import open_key_store
from proxy.storage.redis.link import RedisLink
from tests.keys.relay import HeldCommand

pytestmark = pytest.mark.anyio


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


async def test_memory_keys_are_not_polled_and_changes_hold_at_once() -> None:
    """An idle gateway on memory storage does not wake twice a second for its keys."""
    keys = RuntimeKeys(open_key_store("memory"), SystemClock())
    before = asyncio.all_tasks()
    await keys.start()
    try:
        assert asyncio.all_tasks() == before  # no polling task
        record, secret = await keys.create("alpha", KeyAllowance())
        assert keys.lookup(_digest(secret)) == record
        assert await keys.revoke(record.id)
        assert keys.lookup(_digest(secret)) is None
    finally:
        await keys.aclose()


@pytest.mark.parametrize("which", ["redis", "redis-cluster"])
async def test_redis_keys_are_polled_and_another_replicas_key_arrives(
    which: str, request: pytest.FixtureRequest
) -> None:
    """On one server the version is read on a multiplexed connection, on a cluster through
    redis-py: either way another replica's new key arrives."""
    url = str(request.getfixturevalue(f"{which.replace('-', '_')}_url"))
    here = RuntimeKeys(open_key_store(url), SystemClock())
    there = RuntimeKeys(open_key_store(url), SystemClock())
    await here.start()
    await there.start()
    try:
        record, secret = await there.create("alpha", KeyAllowance())
        deadline = time.monotonic() + 30  # polled twice a second; a loaded machine is slow
        while here.lookup(_digest(secret)) is None:
            assert time.monotonic() < deadline, "the other replica's key never arrived"
            await asyncio.sleep(0.05)
        assert here.lookup(_digest(secret)) == record
    finally:
        await here.aclose()
        await there.aclose()


async def test_a_replica_polling_redis_stops_whenever_it_is_closed(redis_url: str) -> None:
    """Closing a replica ends its poll wherever the poll is: redis-py on Python 3.11 can drop
    the cancel that arrives as a command's write finishes, and the poll went on for ever while
    shutdown waited for it. Polling without pause puts the cancel inside a command each time."""
    for attempt in range(20):
        keys = RuntimeKeys(open_key_store(redis_url), SystemClock(), refresh_s=0.0)
        await keys.start()
        await asyncio.sleep(random.random() * 0.01)  # noqa: S311 - a moment, not a secret
        closing = asyncio.create_task(keys.aclose())
        done, _ = await asyncio.wait([closing], timeout=30)
        assert done == {closing}, f"close number {attempt + 1} never ended"


async def test_a_key_made_while_the_keys_are_read_works_at_once_on_its_replica(
    redis_url: str,
) -> None:
    """The replica read the stored keys just before a key was made on it and installed that
    read just after: the new key answered 401 there until the next poll (2 of 400 keys made
    and used at once under load)."""
    relay = HeldCommand(redis_url, b"HGETALL", reply=True)  # Redis has read the keys
    keys = RuntimeKeys(open_key_store(relay.url), SystemClock(), refresh_s=3600)
    try:
        relay.armed.set()
        starting = asyncio.create_task(keys.start())  # its first read of the keys
        assert await asyncio.to_thread(relay.held.wait, 10)
        record, secret = await keys.create("alpha", KeyAllowance())
        assert keys.lookup(_digest(secret)) == record
        relay.released.set()
        await starting
        assert keys.lookup(_digest(secret)) == record
    finally:
        relay.close()
        await keys.aclose()


@pytest.mark.parametrize("which", ["redis", "redis-unix", "redis-sentinel", "redis-cluster"])
async def test_keys_on_a_storages_link_see_another_replicas_and_leave_the_link_open(
    which: str, request: pytest.FixtureRequest
) -> None:
    """A gateway's keys ride on its storage's link: a key made there works on a replica with
    a connection of its own and the other way round, a revocation reaches each, and closing
    the keys leaves the link to its owner (the storage), which closes it last."""
    url = str(request.getfixturevalue(f"{which.replace('-', '_')}_url"))
    link = RedisLink(url)
    here = RuntimeKeys(open_key_store(url, link), SystemClock(), refresh_s=0.05)
    there = RuntimeKeys(open_key_store(url), SystemClock(), refresh_s=0.05)
    await here.start()
    await there.start()
    try:
        mine, my_secret = await here.create("alpha", KeyAllowance())
        theirs, their_secret = await there.create("beta", KeyAllowance())
        await _until(lambda: there.lookup(_digest(my_secret)) == mine)
        await _until(lambda: here.lookup(_digest(their_secret)) == theirs)
        assert [k.id for k in await here.listed(None)] == [mine.id, theirs.id]
        assert await there.revoke(mine.id)
        await _until(lambda: here.lookup(_digest(my_secret)) is None)
    finally:
        await here.aclose()
        await there.aclose()
    await link.ping()  # still open: the keys did not close their owner's link
    await link.aclose()


async def _until(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 30  # polled every 50 ms; a loaded machine is slow
    while not check():
        assert time.monotonic() < deadline, "the other replica's change never arrived"
        await asyncio.sleep(0.05)
