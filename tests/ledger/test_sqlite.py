"""SQLite specifics: WAL, the versioned schema, locked or shared files, the bounded buffer."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from contextlib import closing
from pathlib import Path

import pytest

from proxy.ledger import LedgerError, SqliteLedger, UsageQuery, open_ledger
from proxy.ledger.present import format_usd
from proxy.ledger.sqlschema import _MIGRATIONS, APPLICATION_ID, SCHEMA_VERSION
from tests.ledger.factory import DAY_S, T0, record

pytestmark = pytest.mark.anyio

EVERYTHING = UsageQuery(None, T0 - DAY_S, T0 + DAY_S)


async def test_file_is_a_versioned_wal_database(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    ledger = SqliteLedger(path)
    await ledger.start()
    await ledger.aclose()
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert conn.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)
        assert conn.execute("PRAGMA application_id").fetchone() == (APPLICATION_ID,)


async def test_relative_and_absolute_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    relative = open_ledger("sqlite:///data.db")
    absolute = open_ledger(f"sqlite:///{tmp_path}/abs.db")
    assert isinstance(relative, SqliteLedger)
    assert isinstance(absolute, SqliteLedger)
    assert (relative.path, absolute.path) == (Path("data.db"), tmp_path / "abs.db")


async def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    with closing(sqlite3.connect(path)) as conn:
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        conn.execute("PRAGMA user_version = 99")
    newest = f"schema v99; this tokenweir reads up to v{SCHEMA_VERSION}"
    with pytest.raises(LedgerError, match=newest):
        await SqliteLedger(path).start()


async def test_a_v1_file_is_migrated_and_keeps_its_records(tmp_path: Path) -> None:
    """A ledger written before the cache's savings existed reads back with zero savings."""
    path = tmp_path / "ledger.db"
    with closing(sqlite3.connect(path)) as conn:
        for statement in _MIGRATIONS[0]:
            conn.execute(statement)
        conn.execute(
            "INSERT INTO usage_records (ts, request_id, tenant, model, backend, operation, stream, "
            "status, error, input_tokens, output_tokens, cost_nusd, cache, ttft_ms, tokens_per_s, "
            "duration_ms, shaped, degraded, client_disconnected) VALUES "
            "(?, 'old', 'alpha', 'm', 'b', 'chat', 0, 200, NULL, 5, 7, 9, 'miss', NULL, NULL, 1.0, "
            "'[]', '[]', 0)",
            (T0,),
        )
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        conn.execute("PRAGMA user_version = 1")
        conn.commit()
    ledger = SqliteLedger(path)
    await ledger.start()
    ledger.append(record(1, saved_cost_nusd=1234))
    await ledger.aclose()
    reader = SqliteLedger(path, read_only=True)
    await reader.start()
    try:
        old, new = sorted(await reader.latest(None, 10), key=lambda r: r.request_id != "old")
    finally:
        await reader.aclose()
    assert (old.input_tokens, old.output_tokens, old.saved_cost_nusd) == (5, 7, 0)
    assert new.saved_cost_nusd == 1234


async def test_another_applications_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    with closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE users (id INTEGER)")
    with pytest.raises(LedgerError, match="not a tokenweir ledger"):
        await SqliteLedger(path).start()


async def test_unwritable_location_fails_at_start(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match="cannot open the ledger database"):
        await SqliteLedger(tmp_path / "missing-dir" / "ledger.db").start()


async def test_read_only_never_creates_a_file(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    with pytest.raises(LedgerError, match="there is no ledger database"):
        await open_ledger(f"sqlite:///{path}", read_only=True).start()
    assert not path.exists()


async def test_read_only_reads_what_a_writer_wrote(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    writer = open_ledger(url)
    await writer.start()
    writer.append(record(1))
    await writer.flush()
    reader = open_ledger(url, read_only=True)
    await reader.start()
    assert [r.requests for r in await reader.query(EVERYTHING)] == [1]
    with pytest.raises(LedgerError, match="read-only"):
        reader.append(record(2))
    await reader.aclose()
    await writer.aclose()


async def test_locked_database_keeps_records_and_retries(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "ledger.db"
    ledger = SqliteLedger(path, busy_timeout_s=0.02, flush_timeout_s=0.3, buffer_records=10)
    await ledger.start()
    with closing(sqlite3.connect(path, isolation_level=None)) as blocker:
        blocker.execute("BEGIN IMMEDIATE")  # another process holding the write lock
        for i in range(15):
            ledger.append(record(i))
        with pytest.raises(LedgerError, match="10 ledger records not yet written"):
            await ledger.flush()
        stats = ledger.stats()
        assert (stats.appended, stats.written, stats.dropped, stats.buffered) == (10, 0, 5, 10)
        assert stats.write_failures >= 1
        assert stats.last_error is not None
        assert "database is locked" in stats.last_error
        blocker.execute("ROLLBACK")
    await ledger.flush()
    assert ledger.stats().written == 10
    assert sum(r.requests for r in await ledger.query(EVERYTHING)) == 10
    await ledger.aclose()
    messages = [r.getMessage() for r in caplog.records if r.name == "tokenweir.ledger"]
    assert any("ledger write failed, 10 records kept and retried" in m for m in messages)
    assert any("buffer full" in m for m in messages)
    assert any("dropped 5 records" in m for m in messages)
    assert any("recovered" in m for m in messages)


async def test_records_still_unwritable_at_close_are_logged_as_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "ledger.db"
    ledger = SqliteLedger(path, busy_timeout_s=0.02, flush_timeout_s=0.2)
    await ledger.start()
    with closing(sqlite3.connect(path, isolation_level=None)) as blocker:
        blocker.execute("BEGIN IMMEDIATE")
        ledger.append(record(1))
        with caplog.at_level(logging.ERROR, "tokenweir.ledger"):
            await ledger.aclose()
        blocker.execute("ROLLBACK")
    assert any(
        "ledger closed with 1 records not written (lost): OperationalError: database is locked"
        in r.getMessage()
        for r in caplog.records
    )


async def test_two_processes_can_share_one_file(tmp_path: Path) -> None:
    """`tokenweir serve --workers 2`: two writers, one file, no record lost or counted twice."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    first, second = open_ledger(url), open_ledger(url)
    await asyncio.gather(first.start(), second.start())
    for i in range(3000):
        (first if i % 2 else second).append(record(i, tenant=f"t{i % 5}"))
        if i % 100 == 0:
            await asyncio.sleep(0)
    await asyncio.gather(first.aclose(), second.aclose())
    reader = open_ledger(url, read_only=True)
    await reader.start()
    rows = await reader.query(EVERYTHING)
    assert [(r.tenant, r.requests) for r in rows] == [(f"t{i}", 600) for i in range(5)]
    assert len(await reader.latest(None, 10_000)) == 3000
    await reader.aclose()


async def test_writers_starting_together_on_a_new_file_both_start(tmp_path: Path) -> None:
    """Two workers creating one file at once: one migrates, the other waits, neither hangs.

    (SQLite refuses `PRAGMA journal_mode = WAL` at once while the other holds the migration's
    lock; the writer thread used to die there and leave `start()` waiting forever.)"""
    for attempt in range(25):
        url = f"sqlite:///{tmp_path / f'ledger-{attempt}.db'}"
        first, second = open_ledger(url), open_ledger(url)
        async with asyncio.timeout(10):
            await asyncio.gather(first.start(), second.start())
        await asyncio.gather(first.aclose(), second.aclose())


async def test_a_record_sqlite_cannot_store_is_dropped_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A lone surrogate cannot be encoded as UTF-8: its whole batch (every tenant's records
    around it) used to be dropped; now only that record is, counted and logged."""
    ledger = SqliteLedger(tmp_path / "ledger.db", interval_s=60.0)  # one batch, at close
    await ledger.start()
    for n in range(5):
        ledger.append(record(n, tenant="bad\ud800" if n == 2 else f"tenant-{n}"))
    with caplog.at_level(logging.ERROR, logger="tokenweir.ledger"):
        await ledger.aclose()
    assert ledger.stats().dropped == 1
    assert ledger.stats().written == 4
    assert any("cannot write" in r.getMessage() for r in caplog.records)
    reader = SqliteLedger(tmp_path / "ledger.db", read_only=True)
    await reader.start()
    try:
        kept = sorted(r.request_id for r in await reader.latest(None, 10))
    finally:
        await reader.aclose()
    assert kept == ["req-0", "req-1", "req-3", "req-4"]


async def test_a_large_batch_is_stored_whole_and_in_order(tmp_path: Path) -> None:
    """A batch goes in by statements of several rows (32, 16, ..., 1): 45 records written in
    one flush come back every one, each field as appended, in the order they came."""
    ledger = SqliteLedger(tmp_path / "ledger.db", interval_s=60.0)  # one batch, at flush
    await ledger.start()
    appended = [
        record(n, tenant=f"tenant-{n % 3}", input_tokens=n, output_tokens=2 * n,
               tags=(f"t{n}",) if n % 2 else (), shaped=("max_tokens",) if n % 5 == 0 else ())
        for n in range(45)
    ]  # fmt: skip
    for item in appended:
        ledger.append(item)
    await ledger.flush()
    try:
        stored = await ledger.latest(None, 100)
    finally:
        await ledger.aclose()
    assert list(reversed(stored)) == appended
    assert ledger.stats().written == 45


async def test_a_full_batch_wakes_a_waiting_writer_at_once(tmp_path: Path) -> None:
    """A batch of one record is full as it comes: the writer, waiting out its interval (an hour
    here), writes it at once, not an interval later."""
    ledger = SqliteLedger(tmp_path / "ledger.db", batch_records=1, interval_s=0.05)
    await ledger.start()
    try:
        await asyncio.sleep(0.5)  # idle intervals: the writer sleeps until a record comes
        ledger._interval_s = 3600.0  # from now on only a full batch (or a flush) writes
        for n in (1, 2):  # the first ends the idle sleep; the second comes during the interval
            await asyncio.sleep(0.2)  # the writer is back in its wait after the first
            ledger.append(record(n))
            deadline = time.monotonic() + 30  # a loaded machine is slow; an hour is the bug
            while ledger.stats().written < n:
                assert time.monotonic() < deadline, ledger.stats()
                await asyncio.sleep(0.01)
    finally:
        await ledger.aclose()


async def test_a_cell_past_int64_is_read_as_an_integer(tmp_path: Path) -> None:
    """9,300 records at the most a record costs (10**15 nano-USD) in one hour: SQLite turns
    the cell's total into a float, which was handed on as one (cost_usd could not format it:
    /api/usage, the dashboard and tokenweir report failed); it is read as an integer now."""
    ledger = SqliteLedger(tmp_path / "ledger.db")
    await ledger.start()
    try:
        for i in range(9300):
            ledger.append(record(i, cost_nusd=10**15))
        await ledger.flush()
        [row] = await ledger.query(EVERYTHING)
    finally:
        await ledger.aclose()
    assert row.requests == 9300
    assert type(row.cost_nusd) is int
    assert abs(row.cost_nusd - 9300 * 10**15) <= 10**4  # a double's 16 digits
    assert format_usd(row.cost_nusd).startswith("9300000000.")
