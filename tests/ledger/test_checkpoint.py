"""Checkpoints of running requests, on every ledger: a crash leaves the last checkpoint, a final
record supersedes them, and no total, raw record or report counts a request twice."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, closing
from dataclasses import replace
from pathlib import Path

import pytest
import redis

from proxy.ledger import RedisLedger, SqliteLedger, UsageRecord, UsageRow
from proxy.ledger.writer import BufferedLedger
from tests.ledger.factory import record
from tests.ledger.test_contract import EVERYTHING, opened
from tests.redis_server import RedisProcess

pytestmark = pytest.mark.anyio


def checkpoints(n: int, outputs: list[int]) -> list[UsageRecord]:
    """Request `n`'s checkpoints with `outputs` tokens so far, each superseding the one before."""
    made: list[UsageRecord] = []
    for output in outputs:
        point = record(
            n, checkpoint=True, output_tokens=output, cost_nusd=output * 10,
            ttft_ms=None, tokens_per_s=None, duration_ms=1000.0 * (len(made) + 1),
        )  # fmt: skip
        made.append(replace(point, supersedes=made[-1] if made else None))
    return made


def totals(rows: list[UsageRow]) -> list[tuple[int, ...]]:
    return [
        (r.requests, r.input_tokens, r.output_tokens, r.cost_nusd, r.duration_ms_total)
        for r in rows
    ]


async def test_a_final_record_supersedes_its_checkpoints_in_totals_and_raw_records(
    ledger_url: str,
) -> None:
    points = checkpoints(1, [10, 20, 30])
    final = record(1, output_tokens=42, cost_nusd=420, supersedes=points[-1])
    other = record(2, output_tokens=5, cost_nusd=50)
    async with opened(ledger_url) as ledger:
        ledger.append(points[0])
        await ledger.flush()  # checkpoints in batches of their own, and one sharing a batch
        ledger.append(points[1])
        await ledger.flush()
        ledger.append(points[2])
        ledger.append(other)
        await ledger.flush()
        (running,) = await ledger.query(EVERYTHING)
        assert totals([running]) == [(2, 200, 35, 350, 3000 + 750)]
        ledger.append(final)
        await ledger.flush()
        (row,) = await ledger.query(EVERYTHING)
        latest = await ledger.latest(None, 10)
    assert totals([row]) == [(2, 200, 47, 470, 750 + 750)]
    assert sorted(latest, key=lambda r: r.request_id) == [final, other]
    assert not any(r.checkpoint for r in latest)


async def test_a_crash_leaves_the_last_checkpoint_and_nothing_twice(ledger_url: str) -> None:
    points = checkpoints(1, [10, 25])
    async with opened(ledger_url) as ledger:
        for point in points:
            ledger.append(point)
    # A new process on the same ledger: the request never ends, its last checkpoint stays.
    async with opened(ledger_url) as ledger:
        (row,) = await ledger.query(EVERYTHING)
        (left,) = await ledger.latest("alpha", 10)
        ledger.append(record(2, output_tokens=7, cost_nusd=70))
        await ledger.flush()
        (after,) = await ledger.query(EVERYTHING)
    assert totals([row]) == [(1, 100, 25, 250, 2000)]
    assert left == points[-1]
    assert left.checkpoint
    assert totals([after]) == [(2, 200, 32, 320, 2750)]


async def test_requests_that_reuse_an_id_are_each_counted(ledger_url: str) -> None:
    # A client-supplied x-request-id may repeat: each request supersedes only its own.
    first = checkpoints(1, [10])
    second = [replace(p, ts=p.ts + 0.5) for p in checkpoints(1, [4])]
    async with opened(ledger_url) as ledger:
        for point in first + second:
            ledger.append(point)
        ledger.append(record(1, ts=second[0].ts, output_tokens=6, supersedes=second[0]))
        ledger.append(record(1, output_tokens=12, supersedes=first[0]))
        await ledger.flush()
        (row,) = await ledger.query(EVERYTHING)
        latest = await ledger.latest(None, 10)
    assert (row.requests, row.output_tokens) == (2, 18)
    assert sorted(r.output_tokens for r in latest) == [6, 12]
    assert not any(r.checkpoint for r in latest)


async def test_a_checkpointed_request_counts_once_by_key_user_and_tag(ledger_url: str) -> None:
    who = {"key_id": "key_abc", "user": "ann", "tags": ("beta", "search")}
    points = [replace(p, **who) for p in checkpoints(1, [10, 20])]
    points[1] = replace(points[1], supersedes=points[0])
    final = record(1, output_tokens=42, cost_nusd=420, supersedes=points[-1], **who)
    async with opened(ledger_url) as ledger:
        for point in points:
            ledger.append(point)
            await ledger.flush()
        ledger.append(final)
        await ledger.flush()
        breakdowns = {
            by: await ledger.query(replace(EVERYTHING, group_by=by))
            for by in ("key", "user", "tag")
        }
    assert [(r.key, r.requests, r.output_tokens) for r in breakdowns["key"]] == [("key_abc", 1, 42)]
    assert [(r.key, r.requests, r.output_tokens) for r in breakdowns["user"]] == [("ann", 1, 42)]
    assert sorted((r.key, r.requests, r.output_tokens) for r in breakdowns["tag"]) == [
        ("beta", 1, 42),
        ("search", 1, 42),
    ]


Outage = tuple[BufferedLedger, Callable[[], Awaitable[None]]]


@asynccontextmanager
async def store_down(kind: str, path: Path) -> AsyncIterator[Outage]:
    """A ledger that buffers 2 records, its store down (a SQLite file another process holds
    locked, a Redis not yet started), and what brings the store back."""
    if kind == "sqlite":
        sqlite = SqliteLedger(path / "ledger.db", buffer_records=2, busy_timeout_s=0.02)
        await sqlite.start()
        with closing(sqlite3.connect(sqlite.path, isolation_level=None)) as blocker:
            blocker.execute("BEGIN IMMEDIATE")

            async def unlock() -> None:
                blocker.execute("ROLLBACK")

            yield sqlite, unlock
        await sqlite.aclose()
        return
    server = RedisProcess()
    ledger = RedisLedger(server.url, buffer_records=2, socket_timeout_s=0.5)
    await ledger.start()

    async def start() -> None:
        await asyncio.to_thread(server.start)

    try:
        yield ledger, start
    finally:
        await ledger.aclose()
        await asyncio.to_thread(server.close)


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
@pytest.mark.parametrize("dropped", [[1, 2], [0]])
async def test_a_checkpoint_dropped_from_a_full_buffer_is_not_taken_out_of_the_totals(
    kind: str, dropped: list[int], tmp_path: Path
) -> None:
    """The store is down and the buffer full when a stream's checkpoints come: they are dropped
    (counted). The request's later records supersede the checkpoint the ledger holds, so its
    totals are its final record's, as its raw record is. The old code took the dropped one's
    share out too: 22 output tokens for 42, or the request not counted at all."""
    points = checkpoints(1, [10, 20, 30])
    final = record(1, output_tokens=42, cost_nusd=420, supersedes=points[-1])
    async with store_down(kind, tmp_path) as (ledger, store_back):
        for point in points[: dropped[0]]:
            ledger.append(point)
        while ledger.stats().buffered < 2:  # other tenants' records fill the buffer
            ledger.append(record(9, tenant="beta"))
        for point in points[dropped[0] : dropped[-1] + 1]:
            ledger.append(point)
        assert ledger.stats().dropped == len(dropped)
        await store_back()
        for later in [*points[dropped[-1] + 1 :], final]:
            await ledger.flush()
            ledger.append(later)
        await ledger.flush()
        rows = await ledger.query(replace(EVERYTHING, tenant="alpha"))
        latest = await ledger.latest("alpha", 10)
    assert totals(rows) == [(1, 100, 42, 420, 750)]
    assert latest == [final]


@pytest.mark.parametrize("lost", ["restarted", "flushed"])
async def test_a_checkpoint_redis_lost_is_not_taken_out_of_the_totals(lost: str) -> None:
    """Redis restarts empty (or is flushed) while a stream runs, after its checkpoint was
    written: the final record supersedes a checkpoint Redis no longer has, so the totals are
    the final record's. The old code took the lost one's share out anyway: the request was not
    counted at all and its input tokens went below zero."""
    points = checkpoints(1, [10, 20])
    final = record(1, output_tokens=42, cost_nusd=420, supersedes=points[-1])
    other = record(2, output_tokens=5, cost_nusd=50)  # in the same batch, superseding nothing
    server = RedisProcess()
    await asyncio.to_thread(server.start)
    try:
        async with opened(server.url) as ledger:
            for point in points:
                ledger.append(point)
                await ledger.flush()
            if lost == "restarted":
                await asyncio.to_thread(server.stop)
                await asyncio.to_thread(server.start)
            else:
                await asyncio.to_thread(_flushall, server.url)
            ledger.append(final)
            ledger.append(other)
            await ledger.flush()
            (row,) = await ledger.query(EVERYTHING)
            latest = await ledger.latest(None, 10)
            assert ledger.stats().dropped == 0
    finally:
        await asyncio.to_thread(server.close)
    assert totals([row]) == [(2, 200, 47, 470, 750 + 750)]
    assert sorted(latest, key=lambda r: r.request_id) == [final, other]


def _flushall(url: str) -> None:
    with redis.Redis.from_url(url) as client:
        client.flushall()
