"""`sqlite:///x.db?keep_records=90d`: raw records past the window are deleted by the writer, the
totals (reports, /api/usage, the dashboard) are kept, and a bad option is refused at load."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from contextlib import closing
from pathlib import Path

import pytest

from proxy.ledger import SqliteLedger, UsageQuery, open_ledger
from proxy.ledger.sqlprune import prune
from proxy.policy import PolicyError, parse_policy
from tests.ledger.factory import DAY_S, record

pytestmark = pytest.mark.anyio


def _raw_ids(path: Path) -> list[str]:
    with closing(sqlite3.connect(path)) as conn:
        return [row[0] for row in conn.execute("SELECT request_id FROM usage_records ORDER BY id")]


async def test_records_past_keep_records_are_deleted_and_the_totals_kept(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    ledger = open_ledger(f"sqlite:///{path}?keep_records=1d")
    assert isinstance(ledger, SqliteLedger)
    now = time.time()
    old = [record(i, ts=now - 3 * DAY_S + i, request_id=f"old-{i}") for i in range(3)]
    new = [record(i, ts=now - 60 + i, request_id=f"new-{i}") for i in range(2)]
    await ledger.start()
    try:
        for each in old + new:
            ledger.append(each)
        await ledger.flush()
        for _ in range(200):  # the prune follows the batch's commit: up to 10 s for it
            if _raw_ids(path) == ["new-0", "new-1"]:
                break
            await asyncio.sleep(0.05)
        assert _raw_ids(path) == ["new-0", "new-1"]
        assert [r.request_id for r in await ledger.latest(None, 10)] == ["new-1", "new-0"]
        [totals] = await ledger.query(UsageQuery(None, now - 4 * DAY_S, now + 60))
        assert totals.requests == 5  # the hour and day totals still count every request
    finally:
        await ledger.aclose()


def test_a_prune_deletes_in_chunks_and_keeps_every_record_inside_the_window(
    tmp_path: Path,
) -> None:
    """Records come in the order requests end: a long request's record (its `ts` its start)
    after shorter ones that started later. Nothing younger than the window goes; an older
    record behind a younger one waits for the window to pass that one."""
    path = tmp_path / "ledger.db"

    async def write() -> None:
        ledger = SqliteLedger(path)
        await ledger.start()
        for n in range(23):
            ledger.append(record(n, ts=1000.0 + n, request_id=f"r{n}"))
        ledger.append(record(99, ts=1005.5, request_id="long"))  # started at 1005.5, ended last
        ledger.append(record(100, ts=1030.0, request_id="last"))
        await ledger.aclose()

    asyncio.run(write())
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        assert prune(conn, before_ts=1010.0, chunk=3) == 10
        assert _raw_ids(path)[:2] == ["r10", "r11"]
        assert "long" in _raw_ids(path)
        assert prune(conn, before_ts=1010.0, chunk=3) == 0
        assert prune(conn, before_ts=1025.0, chunk=4) == 14  # r10..r22 and the long one
        assert _raw_ids(path) == ["last"]
        assert prune(conn, before_ts=2000.0) == 1
        assert _raw_ids(path) == []


POLICY = """
storage: memory
ledger: "{ledger}"
backends: [{{name: b, url: "http://127.0.0.1:9/v1", models: [m]}}]
models: {{m: {{}}}}
tenants: {{}}
"""


@pytest.mark.parametrize(
    ("ledger", "error"),
    [
        ("sqlite:///x.db?keep_records=30m", "at least 1h"),
        ("sqlite:///x.db?keep_records=soon", "duration"),
        ("sqlite:///x.db?keep=90d", "one option, keep_records"),
        ("sqlite:///x.db?keep_records=90d&keep_records=9d", "one option, keep_records"),
    ],
)
def test_a_bad_keep_records_is_refused_at_load(ledger: str, error: str) -> None:
    with pytest.raises(PolicyError, match=error):
        parse_policy(POLICY.format(ledger=ledger), environ={})


def test_keep_records_in_days_loads() -> None:
    policy = parse_policy(POLICY.format(ledger="sqlite:///x.db?keep_records=90d"), environ={})
    assert policy.ledger == "sqlite:///x.db?keep_records=90d"
