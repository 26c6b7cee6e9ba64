"""Spend below the tenant (by key, user, tag), run against SQLite, Redis and Redis Cluster."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from proxy.ledger import GroupBy, UsageQuery, UsageRow
from proxy.ledger.attribution import HOUR_RETENTION_S, MAX_NAMED, OTHER, fold
from proxy.ledger.sqlschema import _CELL_COLUMNS, _MIGRATIONS, APPLICATION_ID, _cell_row
from tests.ledger.factory import DAY_S, HOUR_S, T0, record
from tests.ledger.test_contract import opened, write

pytestmark = pytest.mark.anyio

WEEK = UsageQuery(None, T0 - 3 * DAY_S, T0 + 3 * DAY_S)


def by(rows: list[UsageRow]) -> dict[tuple[str | None, str | None], tuple[int, int]]:
    return {(r.tenant, r.key): (r.requests, r.cost_nusd) for r in rows}


def grouped(q: UsageQuery, group_by: GroupBy) -> UsageQuery:
    return UsageQuery(q.tenant, q.since, q.until, q.bucket, group_by)


async def test_records_keep_key_user_and_tags(ledger_url: str) -> None:
    first = record(1, key_id="key_0123456789abcdef", user="user-7", tags=("search", "beta"))
    second = record(2, key_id="sha256:0a1b2c3d4e5f")
    async with opened(ledger_url) as ledger:
        ledger.append(first)
        ledger.append(second)
        await ledger.flush()
        assert await ledger.latest("alpha", 10) == [second, first]


async def test_spend_grouped_by_key_user_and_tag(ledger_url: str) -> None:
    await write(
        ledger_url,
        [
            record(1, key_id="k1", user="ann", tags=("search", "beta"), cost_nusd=10),
            record(2, key_id="k1", user="bob", tags=("search",), cost_nusd=20),
            record(3, key_id="k2", user=None, tags=(), cost_nusd=40),
            record(4, tenant="beta", key_id="k3", user="ann", tags=("search",), cost_nusd=80),
        ],
    )
    async with opened(ledger_url) as ledger:
        keys = by(await ledger.query(grouped(WEEK, "key")))
        users = by(await ledger.query(grouped(WEEK, "user")))
        tags = by(await ledger.query(grouped(WEEK, "tag")))
        totals = by(await ledger.query(WEEK))
        only_beta = by(await ledger.query(UsageQuery("beta", WEEK.since, WEEK.until, None, "user")))
    assert keys == {("alpha", "k1"): (2, 30), ("alpha", "k2"): (1, 40), ("beta", "k3"): (1, 80)}
    assert users == {
        ("alpha", "ann"): (1, 10),
        ("alpha", "bob"): (1, 20),
        ("alpha", None): (1, 40),
        ("beta", "ann"): (1, 80),
    }
    # A request with two tags counts under each; the tenant's totals count it once.
    assert tags == {
        ("alpha", "beta"): (1, 10),
        ("alpha", "search"): (2, 30),
        ("alpha", None): (1, 40),
        ("beta", "search"): (1, 80),
    }
    assert totals == {("alpha", None): (3, 70), ("beta", None): (1, 80)}
    assert only_beta == {("beta", "ann"): (1, 80)}  # one tenant never sees another's users


async def test_by_hour_and_by_day_buckets_agree(ledger_url: str) -> None:
    records = [record(n, ts=T0 + n * HOUR_S, user=f"u{n % 2}", cost_nusd=n + 1) for n in range(30)]
    await write(ledger_url, records)
    async with opened(ledger_url) as ledger:
        hourly = await ledger.query(UsageQuery(None, T0, T0 + 2 * DAY_S, "hour", "user"))
        whole = by(await ledger.query(UsageQuery(None, T0, T0 + 2 * DAY_S, None, "user")))
    assert len(hourly) == 30
    assert whole == {
        ("alpha", "u0"): (15, sum(n + 1 for n in range(0, 30, 2))),
        ("alpha", "u1"): (15, sum(n + 1 for n in range(1, 30, 2))),
    }


async def test_distinct_users_per_period_are_bounded(ledger_url: str) -> None:
    extra = 7
    records = [record(n, user=f"user-{n}", cost_nusd=1) for n in range(MAX_NAMED + extra)]
    await write(ledger_url, records[:50])
    await write(ledger_url, records[50:])  # the bound holds across batches too
    await write(ledger_url, [record(999, user="user-3", cost_nusd=1)])  # a known one stays named
    async with opened(ledger_url) as ledger:
        rows = by(await ledger.query(grouped(WEEK, "user")))
        totals = by(await ledger.query(WEEK))
    assert len(rows) == MAX_NAMED + 1
    assert rows[("alpha", OTHER)] == (extra, extra)
    assert rows[("alpha", "user-3")] == (2, 2)
    assert sum(requests for requests, _ in rows.values()) == totals[("alpha", None)][0]
    assert totals[("alpha", None)] == (MAX_NAMED + extra + 1, MAX_NAMED + extra + 1)


async def test_an_old_window_by_key_is_answered_in_whole_days(ledger_url: str) -> None:
    """Hour cells by key, user and tag are kept 8 days: an older start widens to its day."""
    start = T0 - 20 * DAY_S + 5 * HOUR_S
    await write(ledger_url, [record(1, ts=start - HOUR_S, key_id="k1"), record(2, key_id="k1")])
    async with opened(ledger_url) as ledger:
        rows = by(await ledger.query(UsageQuery(None, start, T0 + HOUR_S, None, "key")))
        recent = by(await ledger.query(UsageQuery(None, T0, T0 + HOUR_S, None, "key")))
    assert rows == {("alpha", "k1"): (2, 60_000)}  # the earlier hour of that day is counted
    assert recent == {("alpha", "k1"): (1, 30_000)}
    assert HOUR_RETENTION_S < 20 * DAY_S


async def test_an_old_window_inside_two_days_is_answered_in_whole_days(ledger_url: str) -> None:
    """Asked at T0, a window 20 days back from 05:00 to the next day's 13:00 finds its usage
    by key in day cells (its hour cells by key are gone), as much as its totals hold."""
    start = T0 - 20 * DAY_S
    since, until = start - start % DAY_S + 5 * HOUR_S, start - start % DAY_S + 37 * HOUR_S
    old = [record(1, ts=since + HOUR_S, key_id="k1"), record(2, ts=until - HOUR_S, key_id="k1")]
    await write(ledger_url, [*old, record(3, key_id="k1")])
    async with opened(ledger_url) as ledger:
        rows = by(await ledger.query(UsageQuery(None, since, until, None, "key", now=T0)))
        totals = by(await ledger.query(UsageQuery(None, since, until)))
    assert rows == {("alpha", "k1"): (2, 60_000)}
    assert totals == {("alpha", None): (2, 60_000)}


async def test_a_v3_database_is_migrated_and_old_usage_counts_as_none(tmp_path: Path) -> None:
    """Usage a v3 gateway recorded shows as "none" in every breakdown, so breakdowns still sum
    to the totals; new records are attributed."""
    path = tmp_path / "ledger.db"
    hours, days, _, _ = fold([record(1, cost_nusd=5)])
    with closing(sqlite3.connect(path)) as conn:
        for step in _MIGRATIONS[:3]:
            for statement in step:
                conn.execute(statement)
        for table, cells in (("usage_hour", hours), ("usage_day", days)):
            for item in cells.items():
                values = _cell_row(item)
                marks = ", ".join("?" * len(values))
                sql = f"INSERT INTO {table} ({_CELL_COLUMNS}) VALUES ({marks})"  # noqa: S608
                conn.execute(sql, values)
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        conn.execute("PRAGMA user_version = 3")
        conn.commit()
    url = f"sqlite:///{path}"
    await write(url, [record(2, key_id="k1", tags=("a",), cost_nusd=7)])
    async with opened(url) as reader:
        keys = by(await reader.query(grouped(WEEK, "key")))
        tags = by(await reader.query(grouped(WEEK, "tag")))
        latest = await reader.latest(None, 5)
    assert keys == {("alpha", None): (1, 5), ("alpha", "k1"): (1, 7)}
    assert tags == {("alpha", None): (1, 5), ("alpha", "a"): (1, 7)}
    assert latest[0].tags == ("a",)
