"""Calls a store sends again when a Sentinel URL's sentinels name a new primary."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from proxy.storage.base import StorageError
from proxy.storage.redis.link import RedisLink
from proxy.storage.redis.resent import SentAgain
from tests.redis_sentinel import sentinel_topology

pytestmark = pytest.mark.anyio
POOL = "tw:{app}:slots"


async def test_nothing_is_kept_off_sentinel() -> None:
    link = RedisLink("redis://127.0.0.1:1/0")  # never connected
    again = SentAgain(link, "limits_release")
    again.sent([POOL], ["lease"])
    assert again._sent is None
    await link.aclose()


async def test_a_release_the_new_primary_lacks_is_sent_there_once() -> None:
    """As after `SENTINEL FAILOVER`: the old primary took the release after the promotion, so
    the new one still holds the slot."""
    with sentinel_topology() as topology:
        with redis.Redis.from_url(topology.primary_url()) as primary:
            primary.zadd(POOL, {"lease": time.time() + 60})
            assert primary.execute_command("WAIT", 1, 5000) == 1
        link = RedisLink(topology.url)
        sent: list[str] = []
        link.on_primary_switch(lambda: sent.append("switch"))
        again = SentAgain(link, "limits_release")
        try:
            await link.one("limits_held", [POOL], [time.time()])
            again.sent([POOL], ["lease"])  # taken by the old primary: not on the replica
            topology.primary.kill()
            topology.wait_promoted()
            deadline = time.monotonic() + 10
            while not sent:
                assert time.monotonic() < deadline, "the gateway never saw the new primary"
                try:
                    await link.one("limits_held", [POOL], [time.time()])
                except StorageError:  # no primary named yet
                    pass
                await asyncio.sleep(0.1)
            # Sent again once what was on its way may have landed (two storage timeouts).
            with redis.Redis.from_url(topology.replica.url) as new_primary:
                while new_primary.zcard(POOL) != 0:
                    assert time.monotonic() < deadline + 10, "the release was not sent again"
                    await asyncio.sleep(0.1)
            assert sent == ["switch"]
        finally:
            await link.aclose()
