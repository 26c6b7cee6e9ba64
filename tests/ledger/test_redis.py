"""Redis specifics: one cluster slot per tenant, outages buffered, lost replies not billed twice."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

import orjson
import pytest
import redis.asyncio
from redis.crc import key_slot

from proxy.ledger import LedgerError, RedisLedger, UsageQuery, open_ledger
from proxy.ledger import rediskeys as keys
from proxy.ledger.attribution import HOUR_RETENTION_S, MAX_NAMED, OTHER
from tests.ledger.factory import DAY_S, T0, record
from tests.redis_server import RedisProcess
from tests.servers import free_port

pytestmark = pytest.mark.anyio

EVERYTHING = UsageQuery(None, T0 - DAY_S, T0 + DAY_S)


async def total_requests(ledger: RedisLedger) -> int:
    return sum(row.requests for row in await ledger.query(EVERYTHING))


@pytest.mark.parametrize("tenant", ["alpha", "客服", "a{b}c", "x}:ledger:{y", None])
async def test_each_tenants_keys_share_one_cluster_slot(redis_url: str, tenant: str | None) -> None:
    ledger = RedisLedger(redis_url)
    await ledger.start()
    ledger.append(record(1, tenant=tenant))
    ledger.append(record(2, tenant=tenant, ts=T0 + 2 * DAY_S, model="other"))
    await ledger.aclose()
    async with redis.asyncio.Redis.from_url(redis_url, decode_responses=True) as client:
        names = [name async for name in client.scan_iter("tw:*")]
        assert await client.smembers(keys.TENANTS_KEY) == {keys.tag(tenant)}
    tenant_keys = [name for name in names if name != keys.TENANTS_KEY]
    # marker, stream, 2 indexes, 2 hours + 2 days; by key, user and tag 6 indexes and, the
    # records having none of them, one (2 hours + 2 days) per dimension
    assert len(tenant_keys) == 1 + 1 + 2 + 2 * 2 + 6 + 3 * (2 * 2)
    assert len({key_slot(name.encode()) for name in tenant_keys}) == 1
    assert all(name.startswith(f"tw:{{{keys.tag(tenant)}}}:ledger:") for name in tenant_keys)


def test_tags_cannot_collide() -> None:
    assert keys.tag(None) != keys.tag("%anon")
    assert keys.tenant_of(keys.tag("%anon")) == "%anon"
    assert keys.tenant_of(keys.tag(None)) is None
    assert keys.tenant_of(keys.tag("客服")) == "客服"


async def test_ledger_redis_means_the_storage_url(redis_url: str) -> None:
    ledger = open_ledger("redis", storage_url=redis_url)
    assert isinstance(ledger, RedisLedger)
    assert ledger.url == redis_url
    with pytest.raises(ValueError, match="ledger: redis means the Redis named by storage:"):
        open_ledger("redis", storage_url="memory")


async def test_unreachable_redis_buffers_then_writes_when_it_comes_up() -> None:
    server = RedisProcess()  # not started yet: the ledger starts against a Redis that is down
    ledger = RedisLedger(server.url, socket_timeout_s=0.5, flush_timeout_s=5)
    await ledger.start()  # does not need Redis yet
    for i in range(20):
        ledger.append(record(i))
    for _ in range(200):
        if ledger.stats().write_failures:
            break
        await asyncio.sleep(0.01)
    stats = ledger.stats()
    assert (stats.written, stats.buffered, stats.dropped) == (0, 20, 0)
    assert stats.write_failures >= 1
    await asyncio.to_thread(server.start)
    try:
        await ledger.flush()
        assert await total_requests(ledger) == 20
        assert len(await ledger.latest("alpha", 100)) == 20
    finally:
        await ledger.aclose()
        await asyncio.to_thread(server.close)


async def test_records_are_written_after_redis_forgets_the_script(redis_url: str) -> None:
    """A Redis restarted without its scripts (or SCRIPT FLUSHed) answers the writer's EVALSHA
    with NOSCRIPT: the writer sends the script itself (EVAL), nothing lost."""
    ledger = RedisLedger(redis_url, flush_timeout_s=5)
    await ledger.start()
    try:
        ledger.append(record(1))
        await ledger.flush()
        async with redis.asyncio.Redis.from_url(redis_url) as client:
            await client.script_flush()
        ledger.append(record(2))
        ledger.append(record(3, tenant="beta"))
        await ledger.flush()
        assert await total_requests(ledger) == 3
        assert ledger.stats().write_failures == 0
    finally:
        await ledger.aclose()


async def test_a_batch_redis_refuses_is_retried_and_written_once_it_can_be(
    redis_url: str,
) -> None:
    """An error reply (here a tenant's stream key holding a string) fails the batch; it stays
    buffered, is counted, and is written once the key is fixed, each record once."""
    stream = keys.stream_key(keys.tag("alpha"))
    async with redis.asyncio.Redis.from_url(redis_url) as client:
        await client.set(stream, "not a stream")
        ledger = RedisLedger(redis_url, flush_timeout_s=5)
        await ledger.start()
        try:
            ledger.append(record(1))
            for _ in range(500):
                if ledger.stats().write_failures:
                    break
                await asyncio.sleep(0.01)
            assert ledger.stats().write_failures >= 1
            assert ledger.stats().buffered == 1
            await client.delete(stream)
            await ledger.flush()
            assert await total_requests(ledger) == 1
            assert len(await ledger.latest("alpha", 10)) == 1
        finally:
            await ledger.aclose()


async def test_buffer_bound_drops_are_counted_not_silent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ledger = RedisLedger(
        f"redis://127.0.0.1:{free_port()}/0", buffer_records=5, flush_timeout_s=0.2
    )
    await ledger.start()
    for i in range(8):
        ledger.append(record(i))
    with pytest.raises(LedgerError, match="5 ledger records not yet written to Redis"):
        await ledger.flush()
    assert ledger.stats().dropped == 3
    await ledger.aclose()
    messages = [r.getMessage() for r in caplog.records]
    assert any("buffer full (5 records)" in m for m in messages)
    assert any("ledger closed with 5 records not written (lost)" in m for m in messages)


class LossyProxy:
    """A TCP proxy to Redis that, when armed, loses the reply to the next script call."""

    def __init__(self, port: int) -> None:
        self._port = port
        self.armed = False
        self.lost_replies = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/0"

    async def aclose(self) -> None:
        self._server.close()
        for writer in self._writers:
            writer.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self._port)
        self._writers += [client_w, server_w]
        sent_script = asyncio.Event()
        for coro in (
            self._pump(client_r, server_w, sent_script, forward=True),
            self._pump(server_r, client_w, sent_script, forward=False),
        ):
            task = asyncio.create_task(coro)
            self._tasks.add(task)

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        sent_script: asyncio.Event,
        *,
        forward: bool,
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                if forward and b"EVALSHA" in data.upper():
                    sent_script.set()
                if not forward and self.armed and sent_script.is_set():
                    self.armed = False
                    self.lost_replies += 1
                    for peer in self._writers:
                        peer.close()
                    return
                writer.write(data)
                await writer.drain()


async def test_a_batch_whose_reply_was_lost_is_not_counted_twice(redis_url: str) -> None:
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    proxy = LossyProxy(port)
    ledger = RedisLedger(await proxy.start())
    await ledger.start()
    try:
        ledger.append(record(0, tenant="warmup"))
        await ledger.flush()
        proxy.armed = True  # Redis runs the next script, but the gateway never hears back
        for i in range(1, 101):
            ledger.append(record(i, tenant="alpha" if i % 2 else "beta"))
        await ledger.flush()
        assert proxy.lost_replies == 1
        assert ledger.stats().write_failures >= 1
        rows = await ledger.query(EVERYTHING)
        assert [(r.tenant, r.requests) for r in rows] == [
            ("alpha", 50),
            ("beta", 50),
            ("warmup", 1),
        ]
        assert len(await ledger.latest(None, 1000)) == 101
    finally:
        await ledger.aclose()
        await proxy.aclose()


async def test_raw_records_are_capped_totals_are_not(redis_url: str) -> None:
    ledger = RedisLedger(redis_url, stream_records=100)
    await ledger.start()
    for i in range(1000):
        ledger.append(record(i))
    await ledger.aclose()
    async with redis.asyncio.Redis.from_url(redis_url) as client:
        length = await client.xlen(keys.stream_key("alpha"))
    assert 100 <= length < 1000
    reader = RedisLedger(redis_url, read_only=True)
    await reader.start()
    assert await total_requests(reader) == 1000
    await reader.aclose()


async def test_a_million_users_cost_a_bounded_number_of_keys(redis_url: str) -> None:
    """Distinct users past the bound add no keys: 2,000 users in one hour leave 100 named
    aggregates and one (other) per period, and hour aggregates expire within 8 days."""
    ledger = RedisLedger(redis_url)
    await ledger.start()
    for i in range(2000):
        ledger.append(record(i, user=f"user-{i}", tags=(f"tag-{i}",), key_id=f"k{i % 3}"))
    await ledger.aclose()
    async with redis.asyncio.Redis.from_url(redis_url, decode_responses=True) as client:
        tag = keys.tag("alpha")
        for dimension, named in (("user", MAX_NAMED), ("tag", MAX_NAMED), ("key", 3)):
            for granularity in ("hour", "day"):
                index = keys.attr_index_key(tag, granularity, dimension)  # type: ignore[arg-type]
                assert await client.zcard(index) == named + (named == MAX_NAMED)
        prefix = keys.attr_prefix(tag, "hour", "user")
        hour_start = int(T0 // 3600 * 3600)
        assert await client.scard(f"{prefix}names:{hour_start}") == MAX_NAMED
        member = orjson.dumps([hour_start, OTHER]).decode()
        assert 0 < await client.ttl(prefix + member) <= HOUR_RETENTION_S
        assert await client.hget(prefix + member, "requests") == str(2000 - MAX_NAMED)
        every_key = [name async for name in client.scan_iter(f"tw:{{{tag}}}:*")]
    # marker, stream, 2 indexes, 1 hour + 1 day; 6 indexes, 2 x (101 + 101 + 3) aggregates
    # by user, tag and key, and one set of named values per dimension and period
    assert len(every_key) == 6 + 6 + 2 * (101 + 101 + 3) + 6


async def test_totals_past_int64_are_exact_and_each_record_is_written_once(redis_url: str) -> None:
    """9,300 records at the most a record costs (10**15 nano-USD) in one tenant's hour: their
    sum passes Redis's int64. The script failed there half-way through a batch, and each retry
    wrote that batch's records into the stream again while every later record waited."""
    ledger = RedisLedger(redis_url, flush_timeout_s=30.0)
    await ledger.start()
    try:
        for i in range(9300):
            ledger.append(record(i, cost_nusd=10**15, user="ann"))
        await ledger.flush()
        assert ledger.stats().write_failures == 0
        for group_by in (None, "user"):
            [row] = await ledger.query(replace(EVERYTHING, group_by=group_by))
            assert (row.requests, row.cost_nusd) == (9300, 9300 * 10**15)
        assert len(await ledger.latest("alpha", 20_000)) == 9300
    finally:
        await ledger.aclose()
