"""The ledger contract, run against every store: SQLite and a real Redis (one server, Sentinel,
Cluster), on a connection of its own or on a storage's link."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from proxy.ledger import Bucket, Ledger, UsageQuery, UsageRecord, open_ledger
from proxy.ledger.base import MAX_RECORD_CHARS, MAX_RECORD_INT
from proxy.storage.redis.link import RedisLink
from tests.ledger.factory import DAY_S, HOUR_S, T0, record

pytestmark = pytest.mark.anyio

BUCKETS: list[Bucket | None] = [None, "hour", "day"]
EVERYTHING = UsageQuery(None, T0 - 30 * DAY_S, T0 + 30 * DAY_S)


ON_LINK = "on-link:"
"""Before a Redis URL: the ledger on a storage's link, as a gateway's on its storage's Redis."""


@pytest.fixture(
    params=[
        "sqlite", "redis", "redis-cluster",
        "redis-on-link", "redis-sentinel-on-link", "redis-cluster-on-link",
    ]
)  # fmt: skip
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """tests/ledger/conftest.py's stores, and the Redis ones again on a storage's link."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    named = request.param.removesuffix("-on-link")
    url: str = request.getfixturevalue(f"{named.replace('-', '_')}_url")
    return ON_LINK + url if named != request.param else url


@asynccontextmanager
async def opened(url: str) -> AsyncIterator[Ledger]:
    """The ledger at `url`; on a link of the test's (ON_LINK), which outlives the ledger."""
    link = RedisLink(url.removeprefix(ON_LINK)) if url.startswith(ON_LINK) else None
    ledger = open_ledger(url.removeprefix(ON_LINK), link=link)
    await ledger.start()
    try:
        yield ledger
    finally:
        await ledger.aclose()
        if link is not None:
            await link.ping()  # closing the ledger left its link open, for its owner to close
            await link.aclose()


async def write(url: str, records: list[UsageRecord]) -> None:
    async with opened(url) as ledger:
        for r in records:
            ledger.append(r)


async def test_records_read_back_exactly_as_appended(ledger_url: str) -> None:
    records = [
        record(1),
        record(2, tenant=None, model=None, backend=None, status=401, error="invalid_api_key"),
        record(3, tenant="客服机器人", model="qwen2.5:7b", shaped=("history", "max_tokens")),
        record(4, ttft_ms=None, tokens_per_s=None, cache="hit", degraded=("shorten-under-load",)),
        record(5, operation="embeddings", stream=False, client_disconnected=True, cost_nusd=7),
    ]
    async with opened(ledger_url) as ledger:
        for r in records:
            ledger.append(r)
        await ledger.flush()
        everything = await ledger.latest(None, 10)
        assert sorted(everything, key=repr) == sorted(records, key=repr)
        for tenant in ("alpha", None, "客服机器人"):  # each tenant's, the last written first
            mine = [r for r in records[::-1] if r.tenant == tenant]
            assert [r for r in everything if r.tenant == tenant] == mine
        assert await ledger.latest("客服机器人", 10) == [records[2]]
        assert await ledger.latest("alpha", 2) == [records[4], records[3]]


async def test_totals_per_tenant_unauthenticated_last(ledger_url: str) -> None:
    await write(
        ledger_url,
        [
            record(1, tenant="beta", input_tokens=10, output_tokens=1, cost_nusd=5),
            record(2, tenant="alpha", input_tokens=20, output_tokens=2, cost_nusd=7),
            record(3, tenant=None, status=401, input_tokens=0, output_tokens=0, cost_nusd=0),
            record(4, tenant="beta", input_tokens=30, output_tokens=3, cost_nusd=11),
        ],
    )
    async with opened(ledger_url) as ledger:
        rows = await ledger.query(EVERYTHING)
    summary = [(r.tenant, r.requests, r.input_tokens, r.output_tokens, r.cost_nusd) for r in rows]
    assert summary == [("alpha", 1, 20, 2, 7), ("beta", 2, 40, 4, 16), (None, 1, 0, 0, 0)]
    assert rows[2].errors == 1


async def test_one_tenant_sees_only_its_own_usage(ledger_url: str) -> None:
    await write(ledger_url, [record(1, tenant="alpha"), record(2, tenant="beta")])
    async with opened(ledger_url) as ledger:
        rows = await ledger.query(UsageQuery("beta", T0 - DAY_S, T0 + DAY_S))
        assert [(r.tenant, r.requests) for r in rows] == [("beta", 1)]
        assert await ledger.query(UsageQuery("gamma", T0 - DAY_S, T0 + DAY_S)) == []


async def test_outcomes_are_counted(ledger_url: str) -> None:
    await write(
        ledger_url,
        [
            record(1, status=429, error="rate_limit_exceeded", cache="bypass"),
            record(2, status=502, error="upstream_error", degraded=("spill",), cache="bypass"),
            record(3, cache="hit", shaped=("history",)),
            record(4, cache="semantic-hit", client_disconnected=True),
            record(5, cache="miss", duration_ms=1000.4),
        ],
    )
    async with opened(ledger_url) as ledger:
        (row,) = await ledger.query(EVERYTHING)
    assert (row.requests, row.errors, row.rate_limited) == (5, 2, 1)
    assert (row.degraded, row.shaped, row.client_disconnects) == (1, 1, 1)
    assert (row.cache_hits, row.cache_semantic_hits, row.cache_misses) == (1, 1, 1)
    assert row.cache_hit_rate == pytest.approx(2 / 3)
    assert row.duration_ms_total == 4 * 750 + 1000


async def test_group_by_model_and_by_backend(ledger_url: str) -> None:
    await write(
        ledger_url,
        [
            record(1, model="big", backend="a"),
            record(2, model="big", backend="b"),
            record(3, model="small", backend="b"),
            record(4, model=None, backend=None, status=404),
        ],
    )
    async with opened(ledger_url) as ledger:
        by_model = await ledger.query(UsageQuery(None, T0, T0 + 1, group_by="model"))
        by_backend = await ledger.query(UsageQuery(None, T0, T0 + 1, group_by="backend"))
    assert [(r.key, r.requests) for r in by_model] == [("big", 2), ("small", 1), (None, 1)]
    assert [(r.key, r.requests) for r in by_backend] == [("a", 1), ("b", 2), (None, 1)]


async def test_hour_and_day_buckets(ledger_url: str) -> None:
    day0 = T0 - T0 % DAY_S
    times = [day0 + 5, day0 + HOUR_S + 5, day0 + HOUR_S + 6, day0 + DAY_S + 7]
    await write(ledger_url, [record(i, ts=ts) for i, ts in enumerate(times)])
    async with opened(ledger_url) as ledger:
        hours = await ledger.query(UsageQuery("alpha", day0, day0 + 2 * DAY_S, bucket="hour"))
        days = await ledger.query(UsageQuery("alpha", day0, day0 + 2 * DAY_S, bucket="day"))
    assert [(r.bucket_start, r.requests) for r in hours] == [
        (day0, 1),
        (day0 + HOUR_S, 2),
        (day0 + DAY_S, 1),
    ]
    assert [(r.bucket_start, r.requests) for r in days] == [(day0, 3), (day0 + DAY_S, 1)]


async def test_window_is_widened_to_whole_hours(ledger_url: str) -> None:
    times = [T0 - 1, T0 + 1, T0 + 1800, T0 + HOUR_S - 1, T0 + HOUR_S]
    await write(ledger_url, [record(i, ts=ts) for i, ts in enumerate(times)])
    async with opened(ledger_url) as ledger:
        (row,) = await ledger.query(UsageQuery("alpha", T0 + 600, T0 + 1200))
    assert row.requests == 3


async def test_any_window_matches_a_sum_over_raw_records(ledger_url: str) -> None:
    """Day totals in the middle, hour totals at the edges: no record counted twice or missed."""
    rng = random.Random(7)  # noqa: S311 (reproducible records and windows)
    start = T0 - 4 * DAY_S
    records = [
        record(i, ts=start + rng.uniform(0, 8 * DAY_S), tenant=rng.choice(["a", "b"]))
        for i in range(600)
    ]
    records.sort(key=lambda r: r.ts)
    await write(ledger_url, records)
    async with opened(ledger_url) as ledger:
        for _ in range(12):
            since = start + rng.uniform(-DAY_S, 8 * DAY_S)
            until = since + rng.choice([600.0, HOUR_S * 5, DAY_S, DAY_S * 2.5, DAY_S * 6])
            bucket = rng.choice(BUCKETS)
            rows = await ledger.query(UsageQuery(None, since, until, bucket=bucket))
            low = math.floor(since / HOUR_S) * HOUR_S
            high = math.ceil(until / HOUR_S) * HOUR_S
            expected = Counter(r.tenant for r in records if low <= r.ts < high)
            got: Counter[str | None] = Counter()
            for row in rows:
                got[row.tenant] += row.requests
            assert got == expected, (since, until, bucket)


async def test_percentiles_are_within_the_documented_precision(ledger_url: str) -> None:
    rng = random.Random(3)  # noqa: S311 (reproducible samples)
    ttfts = [rng.lognormvariate(math.log(200), 0.8) for _ in range(2000)]
    speeds = [rng.uniform(20, 120) for _ in range(2000)]
    await write(
        ledger_url,
        [
            record(i, ttft_ms=t, tokens_per_s=s)
            for i, (t, s) in enumerate(zip(ttfts, speeds, strict=True))
        ],
    )
    async with opened(ledger_url) as ledger:
        (row,) = await ledger.query(EVERYTHING)

    def exact(values: list[float], q: float) -> float:
        return sorted(values)[math.ceil(q * len(values)) - 1]

    assert row.ttft_ms_p50 == pytest.approx(exact(ttfts, 0.5), rel=0.091)
    assert row.ttft_ms_p95 == pytest.approx(exact(ttfts, 0.95), rel=0.091)
    assert row.tokens_per_s_p50 == pytest.approx(exact(speeds, 0.5), rel=0.091)


async def test_closing_makes_every_appended_record_durable(ledger_url: str) -> None:
    records = [record(i, tenant=f"t{i % 3}") for i in range(2345)]  # several batches
    async with opened(ledger_url) as ledger:
        for r in records:
            ledger.append(r)
        # no flush: aclose alone must write everything
    async with opened(ledger_url) as reopened:
        rows = await reopened.query(EVERYTHING)
        latest = await reopened.latest(None, 5000)
        stats = reopened.stats()
    assert sum(r.requests for r in rows) == 2345
    assert sorted(r.request_id for r in latest) == sorted(r.request_id for r in records)
    assert stats.appended == 0


async def test_stats_count_what_was_appended_and_written(ledger_url: str) -> None:
    async with opened(ledger_url) as ledger:
        for i in range(10):
            ledger.append(record(i))
        await ledger.flush()
        stats = ledger.stats()
    assert (stats.appended, stats.written, stats.dropped, stats.buffered) == (10, 10, 0, 0)
    assert (stats.write_failures, stats.last_error) == (0, None)


async def test_flush_with_nothing_appended_returns_at_once(ledger_url: str) -> None:
    async with opened(ledger_url) as ledger:
        await ledger.flush()
        assert await ledger.query(EVERYTHING) == []
        assert await ledger.latest(None, 10) == []


async def test_appends_after_close_are_counted_as_dropped(
    ledger_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = open_ledger(ledger_url.removeprefix(ON_LINK))
    await ledger.start()
    await ledger.aclose()
    ledger.append(record(1))
    assert ledger.stats().dropped == 1
    assert "dropping records appended after aclose()" in caplog.text


async def test_out_of_range_numbers_are_bounded_and_lose_no_other_record(ledger_url: str) -> None:
    """A backend's 2**64-1 tokens once made SQLite drop its whole batch (other tenants' records
    with it) and Redis retry a failing HINCRBY forever; at append it is clamped instead. So is
    a duration of 1e300 ms, a finite float summed as an integer: SQLite dropped that record,
    and Redis's script wrote part of its batch, then failed, again at every retry."""
    huge = record(
        2, tenant="beta", input_tokens=2**64 - 1, output_tokens=-5, cost_nusd=10**30,
        ttft_ms=math.inf, tokens_per_s=math.nan, model="m" * 10_000, usage_source="backend",
        duration_ms=1e300,
    )  # fmt: skip
    await write(ledger_url, [record(1), huge, record(3)])
    async with opened(ledger_url) as ledger:
        latest = await ledger.latest(None, 10)
        rows = {row.tenant: row for row in await ledger.query(EVERYTHING)}
    assert sorted(r.request_id for r in latest) == ["req-1", "req-2", "req-3"]
    [stored] = [r for r in latest if r.request_id == "req-2"]
    assert (stored.input_tokens, stored.output_tokens) == (MAX_RECORD_INT, 0)
    assert stored.cost_nusd == MAX_RECORD_INT
    assert stored.duration_ms == MAX_RECORD_INT
    assert stored.ttft_ms is None
    assert stored.tokens_per_s is None
    assert stored.model is not None
    assert len(stored.model) <= MAX_RECORD_CHARS
    assert rows["alpha"].requests == 2
    assert rows["beta"].input_tokens == MAX_RECORD_INT
    assert rows["beta"].duration_ms_total == MAX_RECORD_INT


async def test_usage_sources_are_stored_and_counted(ledger_url: str) -> None:
    sources = ["backend", "counted", "estimated", "counted_output", "cache", None]
    made = [
        record(i, usage_source=source, counted_input_tokens=i) for i, source in enumerate(sources)
    ]
    await write(ledger_url, made)
    async with opened(ledger_url) as ledger:
        latest = await ledger.latest(None, 10)
        [row] = await ledger.query(EVERYTHING)
    stored = {r.request_id: (r.usage_source, r.counted_input_tokens) for r in latest}
    assert stored == {f"req-{i}": (source, i) for i, source in enumerate(sources)}
    assert (row.counted_requests, row.estimated_requests) == (2, 1)


async def _written(ledger: Ledger, count: int) -> None:
    """Wait, without a flush, until the writer has stored `count` records."""
    deadline = time.monotonic() + 30  # the writer waits 0.05 s; a loaded machine is slower
    while ledger.stats().written < count:
        assert time.monotonic() < deadline, ledger.stats()
        await asyncio.sleep(0.01)


async def test_the_writer_sleeps_while_idle_and_the_next_record_wakes_it(ledger_url: str) -> None:
    """An idle gateway's writer does not wake every interval to find nothing to write (each
    such wake is CPU an idle gateway burns); a record appended after the idle spell is still
    written on its own, with no flush to push it."""
    async with opened(ledger_url) as ledger:
        ledger.append(record(1))
        await _written(ledger, 1)
        buffer = ledger._buffer  # type: ignore[attr-defined]
        looks: list[float] = []
        next_batch = buffer.next_batch

        def counted(max_records: int) -> object:
            looks.append(time.monotonic())
            return next_batch(max_records)

        buffer.next_batch = counted
        await asyncio.sleep(1.0)  # twenty writer intervals
        idle_looks = len(looks)
        ledger.append(record(2))
        await _written(ledger, 2)
        ledger.append(record(3))
        await _written(ledger, 3)
        latest = await ledger.latest(None, 10)
    assert idle_looks <= 2  # 20 when it polled every interval
    assert sorted(r.request_id for r in latest) == ["req-1", "req-2", "req-3"]


async def test_the_record_that_ends_an_idle_spell_is_written_at_once(ledger_url: str) -> None:
    """The writer, woken from its idle sleep by a record, writes it then and there: it does not
    first wait an interval (an hour here) for others that may never come. At a slow pace this
    is one wake of the writer a record, not two, and the record is durable sooner."""
    async with opened(ledger_url) as ledger:
        await asyncio.sleep(1.0)  # twenty idle intervals: the writer sleeps until a record comes
        ledger._interval_s = 3600.0  # type: ignore[attr-defined]  # from now on
        ledger.append(record(1))
        await _written(ledger, 1)
        latest = await ledger.latest(None, 10)
    assert [r.request_id for r in latest] == ["req-1"]


async def test_costs_past_two_to_the_53_nano_usd_are_summed_exactly(ledger_url: str) -> None:
    """Redis summed a window's hour and day totals as Lua doubles, exact only to 2^53 nano-USD
    ($9 million): a tenant's 40 records of about $1 million each came back 2 nano-USD short of
    what SQLite and the quota count. Now every store sums exactly."""
    costs = [MAX_RECORD_INT - 7 * i for i in range(40)]
    records = [
        record(i, ts=T0 + i * 5400.0, tenant="big", cost_nusd=cost, input_tokens=MAX_RECORD_INT)
        for i, cost in enumerate(costs)
    ]
    await write(ledger_url, records)
    async with opened(ledger_url) as ledger:
        for bucket in BUCKETS:
            rows = await ledger.query(UsageQuery("big", T0, T0 + 3 * DAY_S, bucket=bucket))
            assert sum(row.cost_nusd for row in rows) == sum(costs), bucket
            assert sum(row.input_tokens for row in rows) == 40 * MAX_RECORD_INT, bucket
        (whole,) = await ledger.query(UsageQuery("big", T0 - DAY_S, T0 + 5 * DAY_S))
        assert whole.cost_nusd == sum(costs)
