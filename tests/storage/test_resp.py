"""The multiplexed Redis client of the request path, against a real redis-server: every caller
gets its own reply, however many share the connection, and after timeouts, errors and lost
connections."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from proxy.storage.resp import Multiplexed, can_multiplex
from tests.redis_server import RedisProcess, frozen
from tests.servers import free_port

pytestmark = pytest.mark.anyio

COUNT = "return redis.call('INCRBY', KEYS[1], ARGV[1])"


@pytest.fixture
def server() -> Iterator[RedisProcess]:
    process = RedisProcess()
    process.start()
    try:
        yield process
    finally:
        process.close()


def url_of(server: RedisProcess, db: int = 0, password: str = "") -> str:
    return (
        f"redis://:{password}@127.0.0.1:{server.port}/{db}"
        if password
        else f"{server.url[:-1]}{db}"
    )


def test_only_plain_one_server_urls_are_multiplexed() -> None:
    assert can_multiplex("redis://:pw@10.0.0.1:6380/2")
    for url in (
        "rediss://h:6379/0",
        "redis+sentinel://h:26379/primary",
        "redis+cluster://h:7000",
        "unix:///run/redis.sock",
        "redis://h:6379/0?socket_timeout=5",
    ):
        assert not can_multiplex(url)


async def test_concurrent_calls_each_get_their_own_reply(server: RedisProcess) -> None:
    client = Multiplexed(url_of(server), timeout_s=2)
    try:
        echoed = await asyncio.gather(*(client.execute("ECHO", f"call {i}") for i in range(500)))
    finally:
        await client.aclose()
    assert echoed == [f"call {i}".encode() for i in range(500)]


async def test_it_authenticates_and_selects_the_urls_database(server: RedisProcess) -> None:
    with redis.Redis.from_url(server.url) as admin:
        admin.config_set("requirepass", "s3cret")
    client = Multiplexed(url_of(server, db=3, password="s3cret"), timeout_s=2)
    try:
        await client.execute("SET", "where", "db 3")
    finally:
        await client.aclose()
    with redis.Redis.from_url(url_of(server, db=3, password="s3cret")) as db3:
        assert db3.get("where") == b"db 3"
    wrong = Multiplexed(url_of(server, password="wrong"), timeout_s=2)
    with pytest.raises(ResponseError):
        await wrong.ping()
    await wrong.aclose()


async def test_a_script_is_loaded_when_redis_does_not_know_it(server: RedisProcess) -> None:
    client = Multiplexed(url_of(server), timeout_s=2)
    count = client.register_script(COUNT)
    try:
        assert await count(keys=["n"], args=[2]) == 2
        await client.execute("SCRIPT", "FLUSH")
        assert await count(keys=["n"], args=[3]) == 5
        with redis.Redis.from_url(url_of(server)) as plain:
            assert plain.script_exists(count._sha) == [True]
    finally:
        await client.aclose()


async def test_an_error_reply_fails_its_call_only(server: RedisProcess) -> None:
    client = Multiplexed(url_of(server), timeout_s=2)
    failing = client.register_script("return redis.error_reply('ERR out of tokens')")
    try:
        results = await asyncio.gather(
            client.execute("ECHO", "before"), failing(), client.execute("ECHO", "after"),
            return_exceptions=True,
        )  # fmt: skip
    finally:
        await client.aclose()
    assert results[0] == b"before"
    assert isinstance(results[1], ResponseError)
    assert "out of tokens" in str(results[1])
    assert results[2] == b"after"


async def test_a_late_reply_is_dropped_not_handed_to_the_next_call(server: RedisProcess) -> None:
    client = Multiplexed(url_of(server), timeout_s=0.3)
    try:
        await client.ping()
        with frozen(url_of(server), 1):
            began = time.monotonic()
            with pytest.raises(RedisTimeoutError, match="Timeout"):
                await client.execute("ECHO", "late")
            assert time.monotonic() - began < 0.6
        assert await client.execute("ECHO", "next") == b"next"
    finally:
        await client.aclose()


async def test_a_lost_connection_fails_its_calls_and_the_next_call_reconnects(
    server: RedisProcess,
) -> None:
    client = Multiplexed(url_of(server), timeout_s=2)
    try:
        await client.ping()
        waiting = asyncio.ensure_future(client.execute("BLPOP", "nothing", 5))
        await asyncio.sleep(0)  # written: the call waits for its reply
        with redis.Redis.from_url(url_of(server)) as admin:
            admin.client_kill_filter(_type="normal", skipme=True)
        with pytest.raises(RedisConnectionError):
            await waiting
        assert await client.execute("ECHO", "again") == b"again"
        server.kill()
        with pytest.raises(RedisConnectionError):
            await client.ping()
        server.start()
        await asyncio.sleep(0)
        assert await client.execute("ECHO", "restarted") == b"restarted"
    finally:
        await client.aclose()


async def test_a_refused_connection_fails_at_once() -> None:
    client = Multiplexed(f"redis://127.0.0.1:{free_port()}/0", timeout_s=2)
    began = time.monotonic()
    with pytest.raises(RedisConnectionError, match="connecting to"):
        await client.ping()
    assert time.monotonic() - began < 0.5
    await client.aclose()
