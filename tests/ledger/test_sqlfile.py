"""A SQLite ledger whose file is deleted, renamed or replaced while the gateway writes to it:
records go on to the file at the path (as `tokenweir report` and a restarted gateway read it),
none lost and none counted twice."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, closing
from dataclasses import replace
from pathlib import Path

import pytest

from proxy.ledger import LedgerError, SqliteLedger
from tests.ledger.factory import record
from tests.ledger.test_checkpoint import checkpoints, totals
from tests.ledger.test_sqlite import EVERYTHING

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def writing(path: Path, **options: float) -> AsyncIterator[SqliteLedger]:
    ledger = SqliteLedger(path, **options)  # type: ignore[arg-type]
    await ledger.start()
    try:
        yield ledger
    finally:
        await ledger.aclose()


async def requests_in(path: Path) -> list[str]:
    """The request ids a report on the file at `path` finds, as `tokenweir report` opens it."""
    reader = SqliteLedger(path, read_only=True)
    await reader.start()
    try:
        latest = await reader.latest(None, 1000)
        assert sum(row.requests for row in await reader.query(EVERYTHING)) == len(latest)
        return sorted(r.request_id for r in latest)
    finally:
        await reader.aclose()


def ids(*numbers: int) -> list[str]:
    return sorted(f"req-{n}" for n in numbers)


async def test_records_after_the_file_is_deleted_go_to_a_new_file_at_its_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "ledger.db"
    async with writing(path) as ledger:
        ledger.append(record(1))
        await ledger.flush()
        path.unlink()  # an operator's rm, a cleanup job
        with caplog.at_level(logging.ERROR, "tokenweir.ledger"):
            ledger.append(record(2))
            ledger.append(record(3))
            await ledger.flush()
        assert await requests_in(path) == ids(2, 3)  # while it serves
    assert await requests_in(path) == ids(2, 3)  # and after it stopped
    assert ledger.stats().written == 3
    assert any("was deleted or replaced" in r.getMessage() for r in caplog.records)


async def test_a_renamed_file_keeps_what_it_was_written_and_the_path_gets_the_rest(
    tmp_path: Path,
) -> None:
    path, moved = tmp_path / "ledger.db", tmp_path / "ledger-2026-12.db"
    async with writing(path) as ledger:
        ledger.append(record(1))
        ledger.append(record(2))
        await ledger.flush()
        path.rename(moved)  # a rotation: mv, then the gateway writes a new file
        ledger.append(record(3))
        await ledger.flush()
    assert await requests_in(moved) == ids(1, 2)
    assert await requests_in(path) == ids(3)


async def test_records_wait_while_a_foreign_file_is_in_place_and_are_written_once(
    tmp_path: Path,
) -> None:
    path, kept = tmp_path / "ledger.db", tmp_path / "kept.db"
    async with writing(path, flush_timeout_s=0.5) as ledger:
        ledger.append(record(1))
        await ledger.flush()
        path.rename(kept)
        path.write_bytes(b"not a database, " * 1000)
        ledger.append(record(2))
        with pytest.raises(LedgerError, match="1 ledger records not yet written"):
            await ledger.flush()
        stats = ledger.stats()
        assert (stats.written, stats.buffered, stats.dropped) == (1, 1, 0)
        assert stats.write_failures >= 1
        path.unlink()  # the operator takes the foreign file away
        ledger.append(record(3))
        await ledger.flush()
    assert await requests_in(kept) == ids(1)
    assert await requests_in(path) == ids(2, 3)
    assert (ledger.stats().written, ledger.stats().dropped) == (3, 0)


async def test_a_stream_checkpointed_in_a_deleted_file_counts_once_in_the_new_one(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    first, second, third = checkpoints(1, [10, 20, 30])
    final = record(1, output_tokens=42, cost_nusd=420, supersedes=third)
    async with writing(path) as ledger:
        ledger.append(first)
        await ledger.flush()
        path.unlink()
        ledger.append(second)  # replaces a checkpoint the new file never had
        ledger.append(third)  # replaces the one just before, in the new file
        await ledger.flush()
        ledger.append(final)
        ledger.append(replace(record(2), output_tokens=5, cost_nusd=50))
        await ledger.flush()
        (row,) = await ledger.query(EVERYTHING)
    assert totals([row]) == [(2, 200, 47, 470, 750 + 750)]
    assert await requests_in(path) == ids(1, 2)


async def test_records_wait_while_the_file_is_corrupt_and_go_to_a_new_one_once_it_is_moved(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path, broken = tmp_path / "ledger.db", tmp_path / "broken.db"
    async with writing(path, flush_timeout_s=0.5) as ledger:
        for n in range(300):  # enough pages that some live in the file, not only the WAL
            ledger.append(record(n, tags=(f"tag-{n}",)))
        await ledger.flush()
        with closing(sqlite3.connect(path)) as other:
            other.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        with path.open("r+b") as file:  # a bad disk, a stray write: every page but the first
            file.seek(4096)
            file.write(bytes(range(256)) * (path.stat().st_size // 256))
        with caplog.at_level(logging.ERROR, "tokenweir.ledger"):
            for n in range(300, 310):
                ledger.append(record(n))
            with pytest.raises(LedgerError, match="10 ledger records not yet written"):
                await ledger.flush()
        stats = ledger.stats()
        assert (stats.written, stats.dropped, stats.buffered) == (300, 0, 10)
        path.rename(broken)
        await ledger.flush()
    assert await requests_in(path) == ids(*range(300, 310))
    assert (ledger.stats().written, ledger.stats().dropped) == (310, 0)
    logged = [r.getMessage() for r in caplog.records]
    assert not any("dropped" in m for m in logged)
    assert any("cannot be written (database disk image is malformed)" in m for m in logged)


async def test_a_wal_grown_behind_a_long_reader_is_cut_back_once_it_lets_go(
    tmp_path: Path,
) -> None:
    """A sqlite3 shell (or a long report) holding a read: the WAL grows meanwhile, none of it
    lost, and shrinks back to `wal_keep_bytes` once the reader ends, while the gateway runs."""
    path = tmp_path / "ledger.db"
    wal = tmp_path / "ledger.db-wal"
    async with writing(path, wal_keep_bytes=500_000) as ledger:
        with closing(sqlite3.connect(path, isolation_level=None)) as reader:
            reader.execute("BEGIN")
            reader.execute("SELECT count(*) FROM usage_records").fetchone()
            for n in range(50_000):
                ledger.append(record(n, user=f"user-{n % 100}", tags=(f"tag-{n % 50}",)))
            await ledger.flush()
            grown = wal.stat().st_size
            assert grown > 5_000_000  # past SQLite's checkpoint at 1,000 pages
            reader.execute("COMMIT")
        for n in range(50_000, 50_010):  # a checkpoint reaches the end; the next write resets
            ledger.append(record(n))
            await ledger.flush()
        assert wal.stat().st_size < 1_000_000
        assert ledger.stats().written == 50_010
