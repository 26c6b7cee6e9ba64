"""The SQLite ledger's tables, their versioned migration, and the statements run on a connection.

Blocking calls only: the ledger runs them on its writer thread or in `asyncio.to_thread`.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from proxy.ledger import histogram, sqlattr
from proxy.ledger.aggregate import COUNTERS, Cell, CellKey, Granularity, Tally
from proxy.ledger.attribution import fold, is_attribution
from proxy.ledger.base import LedgerError, UsageQuery, UsageRecord, record_values
from proxy.ledger.query import Span

__all__ = [
    "APPLICATION_ID",
    "SCHEMA_VERSION",
    "connect",
    "read_cells",
    "read_latest",
    "write_batch",
]

SCHEMA_VERSION = 5
APPLICATION_ID = 0x74776C67  # "twlg": marks the file as a tokenweir ledger

_RECORD_COLUMNS = (
    "ts, request_id, tenant, model, backend, operation, stream, status, error, input_tokens, "
    "output_tokens, cost_nusd, cache, ttft_ms, tokens_per_s, duration_ms, shaped, degraded, "
    "client_disconnected, saved_input_tokens, saved_output_tokens, saved_cost_nusd, "
    "usage_source, counted_input_tokens, key_id, user, tags, checkpoint"
)
_CELL_KEY = "tenant, period_start, model, backend"
_CELL_COLUMNS = f"{_CELL_KEY}, {', '.join(COUNTERS)}, ttft_ms_hist, tokens_per_s_hist"
_TABLES: dict[Granularity, str] = {"hour": "usage_hour", "day": "usage_day"}


_SAVED = ("saved_input_tokens", "saved_output_tokens", "saved_cost_nusd")
_SOURCES = ("counted_requests", "estimated_requests")  # schema v3
# Schema v1 had the counters before the cache's savings; its DDL must not change with COUNTERS.
_V1_COUNTERS = tuple(name for name in COUNTERS if name not in _SAVED + _SOURCES)


def _cell_table_ddl(table: str) -> list[str]:
    counters = ", ".join(f"{name} INTEGER NOT NULL" for name in _V1_COUNTERS)
    return [
        f"CREATE TABLE {table} (tenant TEXT NOT NULL, period_start INTEGER NOT NULL, "
        f"model TEXT NOT NULL, backend TEXT NOT NULL, {counters}, "
        "ttft_ms_hist BLOB NOT NULL, tokens_per_s_hist BLOB NOT NULL, "
        f"PRIMARY KEY ({_CELL_KEY})) WITHOUT ROWID",
        f"CREATE INDEX {table}_period ON {table} (period_start)",
    ]


# Version n+1 is reached by running _MIGRATIONS[n]. Never edit a released entry: append one.
_MIGRATIONS: tuple[list[str], ...] = (
    [
        "CREATE TABLE usage_records (id INTEGER PRIMARY KEY, ts REAL NOT NULL, "
        "request_id TEXT NOT NULL, tenant TEXT, model TEXT, backend TEXT, operation TEXT NOT NULL, "
        "stream INTEGER NOT NULL, status INTEGER NOT NULL, error TEXT, "
        "input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL, "
        "cost_nusd INTEGER NOT NULL, cache TEXT NOT NULL, ttft_ms REAL, tokens_per_s REAL, "
        "duration_ms REAL NOT NULL, shaped TEXT NOT NULL, degraded TEXT NOT NULL, "
        "client_disconnected INTEGER NOT NULL)",
        "CREATE INDEX usage_records_tenant ON usage_records (tenant)",
        *_cell_table_ddl("usage_hour"),
        *_cell_table_ddl("usage_day"),
    ],
    [
        f"ALTER TABLE {table} ADD COLUMN {name} INTEGER NOT NULL DEFAULT 0"
        for table in ("usage_records", "usage_hour", "usage_day")
        for name in _SAVED
    ],
    [
        "ALTER TABLE usage_records ADD COLUMN usage_source TEXT",
        "ALTER TABLE usage_records ADD COLUMN counted_input_tokens INTEGER NOT NULL DEFAULT 0",
        *(
            f"ALTER TABLE {table} ADD COLUMN {name} INTEGER NOT NULL DEFAULT 0"
            for table in ("usage_hour", "usage_day")
            for name in _SOURCES
        ),
    ],
    sqlattr.MIGRATION,
    ["ALTER TABLE usage_records ADD COLUMN checkpoint INTEGER NOT NULL DEFAULT 0"],
)
assert len(_MIGRATIONS) == SCHEMA_VERSION  # noqa: S101 - a release-time invariant


_ROW = f"({', '.join('?' * 28)})"
# Records go in by statements of 32, 16, ..., 1 rows (32 x 28 values is under SQLite's oldest
# limit of 999): a batch is a few statements, not one per record. Each statement's step lets go
# of the GIL and must take it back from a busy event loop, which costs the writer thread about
# 50 µs of CPU each time (benchmarks.md, "the ledger's writer"); six statement texts in all.
_CHUNKS = (32, 16, 8, 4, 2, 1)
_INSERT_ROWS = {
    n: f"INSERT INTO usage_records ({_RECORD_COLUMNS}) VALUES {', '.join([_ROW] * n)}"  # noqa: S608
    for n in _CHUNKS
}
_INSERT_RECORD = _INSERT_ROWS[1]
_DELETE_RECORD = "DELETE FROM usage_records WHERE id = ?"
_UPSERT = {g: sqlattr.upsert_sql(table, _CELL_KEY) for g, table in _TABLES.items()}


def connect(
    path: Path, *, busy_timeout_s: float, writer: bool, wal_keep_bytes: int = 64 << 20
) -> sqlite3.Connection:
    """The writer's connection (WAL, schema migrated) or a read-only one (schema checked)."""
    try:
        if writer:
            conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None)
        else:
            uri = path.resolve().as_uri() + "?mode=ro"
            conn = sqlite3.connect(uri, uri=True, timeout=busy_timeout_s, isolation_level=None)
    except sqlite3.Error as exc:
        raise LedgerError(f"cannot open the ledger database {path}: {exc}") from exc
    try:
        if writer:
            # WAL: readers never block the writer. NORMAL: a commit survives a crash of this
            # process; an OS crash or power cut may roll back the last commits, never corrupt.
            _set_wal(conn, busy_timeout_s)
            conn.execute("PRAGMA synchronous = NORMAL")
            # A reader holding a transaction (a long report, a sqlite3 shell) keeps checkpoints
            # from reaching the WAL's end, and the WAL grows: once one does, SQLite cuts it back
            # to this size (else it stays that large until the last connection closes).
            conn.execute(f"PRAGMA journal_size_limit = {int(wal_keep_bytes)}")
            conn.create_function("tw_hist_add", 2, _hist_add, deterministic=True)
            _migrate(conn, path)
        else:
            # typeshed admits only int-valued aggregates; SQLite takes blobs just the same
            conn.create_aggregate("tw_hist_sum", 1, histogram.BlobSum)  # type: ignore[arg-type]
            _check_version(conn, path)
    except sqlite3.Error as exc:
        conn.close()
        raise LedgerError(f"cannot prepare the ledger database {path}: {exc}") from exc
    except BaseException:
        conn.close()
        raise
    return conn


def _set_wal(conn: sqlite3.Connection, timeout_s: float) -> None:
    """Switch to WAL, waiting out another writer that is creating or migrating the file: SQLite
    answers "database is locked" at once here, without its busy handler."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError:
            if time.monotonic() >= deadline_s:
                raise
            time.sleep(0.01)


def _migrate(conn: sqlite3.Connection, path: Path) -> None:
    try:
        conn.execute("BEGIN IMMEDIATE")  # one migrator at a time across processes
        version = _check_version(conn, path, allow_older=True)
        for step in _MIGRATIONS[version:]:
            for statement in step:
                conn.execute(statement)
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except sqlite3.Error as exc:
        _rollback(conn)
        raise LedgerError(f"cannot prepare the ledger database {path}: {exc}") from exc


def _check_version(conn: sqlite3.Connection, path: Path, *, allow_older: bool = False) -> int:
    try:
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
    except sqlite3.Error as exc:
        raise LedgerError(f"cannot read the ledger database {path}: {exc}") from exc
    if app_id not in (0, APPLICATION_ID) or (app_id == 0 and tables):
        raise LedgerError(f"{path} is not a tokenweir ledger database")
    if version > SCHEMA_VERSION:
        raise LedgerError(
            f"{path} has ledger schema v{version}; this tokenweir reads up to v{SCHEMA_VERSION}"
        )
    if version < SCHEMA_VERSION and not allow_older:
        raise LedgerError(
            f"{path} has ledger schema v{version} (current v{SCHEMA_VERSION}): "
            "start the gateway once to migrate it"
        )
    return int(version)


def write_batch(
    conn: sqlite3.Connection, records: Sequence[UsageRecord], checkpoints: dict[str, int]
) -> None:
    """Raw records and their hour and day totals, in one transaction.

    `checkpoints` maps each running request's checkpoint (its `link`) to its raw row: a record
    that supersedes one replaces that row. Updated only once the transaction commits.
    """
    hours, days, attr_hours, attr_days = fold(records)
    linked = any(r.checkpoint or r.supersedes is not None for r in records)
    rows = dict(checkpoints) if linked else checkpoints
    conn.execute("BEGIN IMMEDIATE")
    try:
        if linked:
            _insert_linked(conn, records, rows)
        else:
            _insert(conn, records)
        conn.executemany(_UPSERT["hour"], map(_cell_row, hours.items()))
        conn.executemany(_UPSERT["day"], map(_cell_row, days.items()))
        newest_ts = max(r.ts for r in records)
        sqlattr.write(conn, {"hour": attr_hours, "day": attr_days}, newest_ts)
        conn.execute("COMMIT")
    except BaseException:
        _rollback(conn)
        raise
    if linked:
        checkpoints.clear()
        checkpoints.update(rows)


def _insert(conn: sqlite3.Connection, records: Sequence[UsageRecord]) -> None:
    """The records' raw rows, in order, in as few statements as _CHUNKS allow."""
    done = 0
    for size in _CHUNKS:
        while len(records) - done >= size:
            values = [value for r in records[done : done + size] for value in _record_row(r)]
            conn.execute(_INSERT_ROWS[size], values)
            done += size


def _insert_linked(
    conn: sqlite3.Connection, records: Sequence[UsageRecord], rows: dict[str, int]
) -> None:
    """One insert per record, in order: a checkpoint's row is noted, a superseded one deleted."""
    for record in records:
        if record.supersedes is not None:
            superseded = rows.pop(record.supersedes.link, None)
            if superseded is not None:
                conn.execute(_DELETE_RECORD, (superseded,))
        cursor = conn.execute(_INSERT_RECORD, _record_row(record))
        if record.checkpoint and cursor.lastrowid is not None:
            rows[record.link] = cursor.lastrowid


_TUPLE_COLUMNS = (16, 17, 26)  # shaped, degraded, tags: in RECORD_FIELDS' order
_BUCKET_SQL = {"hour": "period_start", "day": "period_start - period_start % 86400", None: "0"}
_SUMS_SQL = ", ".join(f"SUM({name})" for name in COUNTERS)


def read_cells(conn: sqlite3.Connection, span: Span, q: UsageQuery) -> list[Cell]:
    """The span's cells, already summed in SQL per (tenant, bucket, model or backend).

    A summed cell's period is its bucket's start, and the column not grouped by is blank.
    """
    if is_attribution(q):
        return sqlattr.read_cells(conn, span.granularity, span.start, span.end, q)
    model = "model" if q.group_by == "model" else "''"
    backend = "backend" if q.group_by == "backend" else "''"
    sql = (
        f"SELECT tenant, {_BUCKET_SQL[q.bucket]}, {model}, {backend}, {_SUMS_SQL}, "  # noqa: S608
        "tw_hist_sum(ttft_ms_hist), tw_hist_sum(tokens_per_s_hist) "
        f"FROM {_TABLES[span.granularity]} WHERE period_start >= ? AND period_start < ?"
    )
    params: tuple[object, ...] = (span.start, span.end)
    if q.tenant is not None:
        sql += " AND tenant = ?"
        params += (q.tenant,)
    return [_cell(row) for row in conn.execute(sql + " GROUP BY 1, 2, 3, 4", params)]


def read_latest(conn: sqlite3.Connection, tenant: str | None, limit: int) -> list[UsageRecord]:
    where = "" if tenant is None else "WHERE tenant = ? "
    params: tuple[object, ...] = (limit,) if tenant is None else (tenant, limit)
    sql = f"SELECT {_RECORD_COLUMNS} FROM usage_records {where}ORDER BY id DESC LIMIT ?"  # noqa: S608
    return [_record(row) for row in conn.execute(sql, params)]


def _record_row(r: UsageRecord) -> tuple[object, ...]:
    # The tuple columns (shaped, degraded, tags) are stored as JSON text.
    row = list(record_values(r))
    for names in _TUPLE_COLUMNS:
        row[names] = orjson.dumps(row[names]).decode()
    return tuple(row)


def _record(row: tuple[Any, ...]) -> UsageRecord:
    values = list(row)
    for flag in (6, 18, 27):
        values[flag] = bool(values[flag])
    for names in _TUPLE_COLUMNS:
        values[names] = tuple(orjson.loads(values[names]))
    return UsageRecord(*values)


def _cell_row(item: tuple[CellKey, Tally]) -> tuple[object, ...]:
    return sqlattr.cell_row(*item)


def _cell(row: tuple[Any, ...]) -> Cell:
    tenant, start, model, backend = row[:4]
    return Cell((tenant or None, start, model or None, backend or None), sqlattr.tally_of(row, 4))


def _hist_add(left: bytes | None, right: bytes | None) -> bytes:
    merged = histogram.decode(left)
    histogram.merge_into(merged, histogram.decode(right).items())
    return histogram.encode(merged)


def _rollback(conn: sqlite3.Connection) -> None:
    if conn.in_transaction:
        conn.execute("ROLLBACK")
