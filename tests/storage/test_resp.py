"""The multiplexed Redis client of the request path, against a real redis-server: every caller
gets its own reply, however many share the connection, and after timeouts, errors and lost
connections."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from proxy.storage.limits import SlotPool
from proxy.storage.redis.limits import RedisLimitStore
from proxy.storage.redis.resp import Multiplexed, can_multiplex
from tests.redis_server import RedisProcess, frozen, listening_on, tls_redis
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


def test_only_one_server_urls_it_can_honour_are_multiplexed() -> None:
    assert can_multiplex("redis://:pw@10.0.0.1:6380/2")
    assert can_multiplex("rediss://h:6379/0?ssl_ca_certs=/etc/ca.pem&ssl_check_hostname=false")
    assert can_multiplex("unix:///run/redis.sock")
    assert can_multiplex("unix://:pw@/run/redis.sock?db=2")
    for url in (
        "redis+sentinel://h:26379/primary",
        "redis+cluster://h:7000",
        "unix:///run/redis.sock?socket_timeout=5",
        "redis://h:6379/0?socket_timeout=5",
        "rediss://h:6379/0?ssl_ca_certs=/etc/ca.pem&protocol=3",
    ):
        assert not can_multiplex(url)


async def test_concurrent_calls_each_get_their_own_reply(server: RedisProcess) -> None:
    async with Multiplexed(url_of(server), timeout_s=2) as client:
        echoed = await asyncio.gather(*(client.execute("ECHO", f"call {i}") for i in range(500)))
    assert echoed == [f"call {i}".encode() for i in range(500)]


async def test_it_authenticates_and_selects_the_urls_database(server: RedisProcess) -> None:
    with redis.Redis.from_url(server.url) as admin:
        admin.config_set("requirepass", "s3cret")
    async with Multiplexed(url_of(server, db=3, password="s3cret"), timeout_s=2) as client:
        await client.execute("SET", "where", "db 3")
    with redis.Redis.from_url(url_of(server, db=3, password="s3cret")) as db3:
        assert db3.get("where") == b"db 3"
    wrong = Multiplexed(url_of(server, password="wrong"), timeout_s=2)
    with pytest.raises(ResponseError):
        await wrong.ping()
    await wrong.aclose()


async def test_a_script_is_loaded_when_redis_does_not_know_it(server: RedisProcess) -> None:
    async with Multiplexed(url_of(server), timeout_s=2) as client:
        count = client.register_script(COUNT)
        assert await count(keys=["n"], args=[2]) == 2
        await client.execute("SCRIPT", "FLUSH")
        assert await count(keys=["n"], args=[3]) == 5
        with redis.Redis.from_url(url_of(server)) as plain:
            assert plain.script_exists(count._sha) == [True]


async def test_an_error_reply_fails_its_call_only(server: RedisProcess) -> None:
    async with Multiplexed(url_of(server), timeout_s=2) as client:
        failing = client.register_script("return redis.error_reply('ERR out of tokens')")
        results = await asyncio.gather(
            client.execute("ECHO", "before"), failing(), client.execute("ECHO", "after"),
            return_exceptions=True,
        )  # fmt: skip
    assert results[0] == b"before"
    assert isinstance(results[1], ResponseError)
    assert "out of tokens" in str(results[1])
    assert results[2] == b"after"


async def test_a_call_with_no_answer_in_time_fails_with_the_calls_behind_it(
    server: RedisProcess,
) -> None:
    async with Multiplexed(url_of(server), timeout_s=1.0) as client:
        await client.ping()
        with frozen(url_of(server), 3):
            began = time.monotonic()
            first = asyncio.ensure_future(client.execute("ECHO", "first"))
            await asyncio.sleep(0.8)
            behind = asyncio.ensure_future(client.execute("ECHO", "behind"))
            with pytest.raises(RedisTimeoutError, match="Timeout"):
                await first
            with pytest.raises(RedisTimeoutError, match="an earlier call had no answer"):
                await behind  # failed with the first, not 0.8 s later by its own timeout
            assert time.monotonic() - began < 1.8  # its own would end at 1.8 s at the earliest
        assert await client.execute("ECHO", "next") == b"next"


async def test_a_calls_time_counts_from_its_own_sending_not_the_first_calls(
    server: RedisProcess,
) -> None:
    """The connection's one timer is set by the first call; a call sent two seconds later,
    and answered after two more, is within its own three and gets its reply."""
    async with Multiplexed(url_of(server), timeout_s=3.0) as client:
        assert await client.execute("ECHO", "first") == b"first"  # the timer: due at 3 s
        await asyncio.sleep(2.0)
        with frozen(url_of(server), 2):  # answers again at most 2 s after this call is sent
            assert await client.execute("ECHO", "later") == b"later"


async def test_a_cancelled_calls_reply_is_dropped_not_handed_to_the_next_call(
    server: RedisProcess,
) -> None:
    async with Multiplexed(url_of(server), timeout_s=5) as client:
        await client.ping()
        with frozen(url_of(server), 1):
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.execute("ECHO", "cancelled"), 0.2)
        assert await client.execute("ECHO", "next") == b"next"


async def test_a_connection_to_a_host_gone_silent_is_left_for_a_new_one(
    server: RedisProcess,
) -> None:
    """The first connection is swallowed (no reply, no FIN, no RST, as when a host drops off
    the network); later ones reach Redis. Only one call's timeout is lost."""
    handlers: list[asyncio.Task[None]] = []

    async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        while data := await source.read(65536):
            sink.write(data)
        sink.close()
        await sink.wait_closed()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.append(asyncio.current_task())  # type: ignore[arg-type]
        if len(handlers) == 1:
            await reader.read()  # swallow everything until the client leaves
            writer.close()
            await writer.wait_closed()
            return
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", server.port)
        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))

    relay_server = await asyncio.start_server(relay, "127.0.0.1", 0)
    port = relay_server.sockets[0].getsockname()[1]
    try:
        async with Multiplexed(f"redis://127.0.0.1:{port}/0", timeout_s=0.3) as client:
            with pytest.raises(RedisTimeoutError):
                await client.ping()
            assert await client.execute("ECHO", "reached") == b"reached"
            assert len(handlers) == 2
    finally:
        relay_server.close()  # once the client has gone, the relay's handlers end
        await asyncio.gather(*handlers)


async def test_a_lost_connection_fails_its_calls_and_the_next_call_reconnects(
    server: RedisProcess,
) -> None:
    async with Multiplexed(url_of(server), timeout_s=2) as client:
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


async def test_it_speaks_over_a_unix_socket_with_the_urls_login_and_database(
    tmp_path: Path,
) -> None:
    """unix://: a co-located Redis without TCP; AUTH and `?db=` as for redis://."""
    path = tmp_path / "redis.sock"
    server = RedisProcess(listening_on(path))
    server.start()
    try:
        with redis.Redis.from_url(server.url) as admin:
            admin.config_set("requirepass", "s3cret")
        url = f"unix://:s3cret@{path}?db=4"
        async with Multiplexed(url, timeout_s=2) as client:
            echoed = await asyncio.gather(*(client.execute("ECHO", f"{i}") for i in range(200)))
            await client.execute("SET", "where", "db 4 by socket")
        assert echoed == [f"{i}".encode() for i in range(200)]
        with redis.Redis.from_url(url_of(server, db=4, password="s3cret")) as db4:
            assert db4.get("where") == b"db 4 by socket"  # the same server, over TCP
    finally:
        server.close()
    gone = Multiplexed(f"unix://{path}", timeout_s=2)
    with pytest.raises(RedisConnectionError, match=f"connecting to {path}"):
        await gone.ping()  # the socket's path, in the error
    await gone.aclose()


async def test_a_refused_connection_fails_at_once() -> None:
    client = Multiplexed(f"redis://127.0.0.1:{free_port()}/0", timeout_s=20)
    began = time.monotonic()
    with pytest.raises(RedisConnectionError, match="connecting to"):
        await client.ping()
    assert time.monotonic() - began < 10  # refused, not timed out
    await client.aclose()


@pytest.fixture
def tls_url(tmp_path: Path) -> Iterator[str]:
    with tls_redis(tmp_path) as (_, url):
        yield url


async def test_it_speaks_tls_checking_the_servers_certificate(tls_url: str) -> None:
    async with Multiplexed(tls_url, timeout_s=10) as client:  # a handshake on busy cores
        assert await client.execute("ECHO", "over tls") == b"over tls"
    untrusting = Multiplexed(tls_url.split("?")[0], timeout_s=10)  # unknown to the system's CAs
    with pytest.raises(RedisConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        await untrusting.ping()
    await untrusting.aclose()


async def test_the_stores_run_their_scripts_over_tls(tls_url: str) -> None:
    # Not the 1 s default: a TLS handshake with both cores busy has taken longer (a loaded run).
    limits = RedisLimitStore(tls_url, timeout_s=10)
    pool = SlotPool("tw:{t}:slots", 1)
    try:
        first = await limits.admit(
            "tw:{t}", [], [], [pool], lease_id="a", lease_until=time.time() + 60, now=time.time()
        )
        second = await limits.admit(
            "tw:{t}", [], [], [pool], lease_id="b", lease_until=time.time() + 60, now=time.time()
        )
    finally:
        await limits.aclose()
    assert (first.admitted, second.admitted) == (True, False)


async def test_a_closed_client_does_not_connect_again(server: RedisProcess) -> None:
    client = Multiplexed(url_of(server), timeout_s=2)
    await client.ping()
    await client.aclose()
    with pytest.raises(RedisConnectionError, match="closed"):
        await client.ping()  # at shutdown, a late call must not open a connection left open
