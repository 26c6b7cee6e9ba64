"""What the gateway keeps by name on the storage's link (ended dashboard sessions, whose each
stored response is): on every storage, and across a graceful Sentinel failover, where the
link's connections move to the new primary by themselves."""

from __future__ import annotations

import time

import pytest
import redis

from proxy.storage import StorageError, open_storage
from proxy.storage.owned import open_owned_ids, owner_key
from proxy.storage.sessions import open_ended_sessions
from tests.redis_sentinel import SERVICE, sentinel_topology

NOW = 1_900_000_000.0  # ahead of Redis's own clock: its keys do not expire during a test


@pytest.mark.anyio
async def test_an_ended_session_is_refused_until_its_cookie_expires(storage_url: str) -> None:
    storage = open_storage(storage_url)
    ended = open_ended_sessions(storage)
    try:
        await ended.end(b"\x01" * 16, NOW + 60, NOW)
        assert await ended.ended(b"\x01" * 16, NOW)
        assert not await ended.ended(b"\x02" * 16, NOW)
        if storage_url == "memory":  # Redis's own clock expires its keys
            assert not await ended.ended(b"\x01" * 16, NOW + 61)
    finally:
        await ended.aclose()
        await storage.aclose()


@pytest.mark.anyio
async def test_marks_follow_a_graceful_sentinel_failover() -> None:
    """`SENTINEL FAILOVER` leaves the old primary up (a primary for 8 s or more): marks made
    before it are read on the new primary, and new ones are written there within seconds."""
    with sentinel_topology() as topology:
        storage = open_storage(topology.url)
        owned, ended = open_owned_ids(storage), open_ended_sessions(storage)
        try:
            await owned.claim("alice", "resp_before", NOW)
            await ended.end(b"\x01" * 16, NOW, NOW - 60)
            with redis.Redis.from_url(topology.primary_url()) as primary:
                assert primary.wait(1, 5000) == 1  # the replica has them
            _fail_over(topology.sentinel_port)
            topology.wait_promoted()
            with redis.Redis.from_url(topology.replica.url) as new_primary:
                deadline = time.monotonic() + 5  # well before the old primary steps down
                made = 0
                while not new_primary.exists(owner_key("alice", f"resp_{made}")):
                    assert time.monotonic() < deadline, "claims still go to the old primary"
                    made += 1
                    try:
                        await owned.claim("alice", f"resp_{made}", NOW)
                    except StorageError:  # the old primary's connection, dropped
                        pass
            assert await owned.owns("alice", "resp_before", NOW - 60)
            assert await owned.owns("alice", f"resp_{made}", NOW - 60)
            assert not await owned.owns("bob", "resp_before", NOW - 60)
            assert await ended.ended(b"\x01" * 16, NOW - 60)
        finally:
            await storage.aclose()


def _fail_over(sentinel_port: int) -> None:
    """A graceful failover, once the sentinel has seen the replica answer (NOGOODSLAVE
    before: a sentinel just started has not asked it yet)."""
    deadline = time.monotonic() + 20
    with redis.Redis(port=sentinel_port) as sentinel:
        while True:
            try:
                sentinel.execute_command("SENTINEL", "FAILOVER", SERVICE)
                return
            except redis.ResponseError as exc:
                if "NOGOODSLAVE" not in str(exc) or time.monotonic() > deadline:
                    raise
            time.sleep(0.2)
