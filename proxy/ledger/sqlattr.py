"""The SQLite ledger's totals by key, user and tag: their tables, capped upserts and reads.

Blocking calls only, run inside the writer's transaction or a reader's `asyncio.to_thread`.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from proxy.ledger import histogram
from proxy.ledger.aggregate import COUNTERS, Cell, Granularity, Tally
from proxy.ledger.attribution import HOUR_RETENTION_S, AttrKey, capped
from proxy.ledger.base import UsageQuery

__all__ = ["MIGRATION", "cell_row", "read_cells", "tally_of", "upsert_sql", "write"]

TABLES: dict[Granularity, str] = {"hour": "usage_hour_attr", "day": "usage_day_attr"}
_KEY = "tenant, period_start, dimension, value"
_COLUMNS = f"{_KEY}, {', '.join(COUNTERS)}, ttft_ms_hist, tokens_per_s_hist"


def _table_ddl(table: str, source: str) -> list[str]:
    counters = ", ".join(f"{name} INTEGER NOT NULL DEFAULT 0" for name in COUNTERS)
    copied = ", ".join(COUNTERS)
    ddl = [
        f"CREATE TABLE {table} (tenant TEXT NOT NULL, period_start INTEGER NOT NULL, "
        f"dimension TEXT NOT NULL, value TEXT NOT NULL, {counters}, "
        "ttft_ms_hist BLOB NOT NULL, tokens_per_s_hist BLOB NOT NULL, "
        f"PRIMARY KEY ({_KEY})) WITHOUT ROWID",
        f"CREATE INDEX {table}_period ON {table} (period_start)",
    ]
    # Usage recorded before attribution existed counts as "none" in every breakdown, so a
    # breakdown of an old window still sums to its totals.
    for dimension in ("key", "user", "tag"):
        ddl.append(
            f"INSERT INTO {table} ({_COLUMNS}) SELECT tenant, period_start, '{dimension}', '', "  # noqa: S608
            f"{copied}, ttft_ms_hist, tokens_per_s_hist FROM {source}"
        )
    return ddl


MIGRATION: list[str] = [
    "ALTER TABLE usage_records ADD COLUMN key_id TEXT",
    "ALTER TABLE usage_records ADD COLUMN user TEXT",
    "ALTER TABLE usage_records ADD COLUMN tags TEXT NOT NULL DEFAULT '[]'",
    *_table_ddl("usage_hour_attr", "usage_hour"),
    *_table_ddl("usage_day_attr", "usage_day"),
]
"""Schema v3 -> v4: the records' attribution columns and the attribution totals."""


def upsert_sql(table: str, key: str) -> str:
    """Add a cell's counters and histograms to the row of its key (`key`: the key columns)."""
    updates = ", ".join(f"{name} = {name} + excluded.{name}" for name in COUNTERS)
    columns = f"{key}, {', '.join(COUNTERS)}, ttft_ms_hist, tokens_per_s_hist"
    placeholders = ", ".join("?" * (key.count(",") + 1 + len(COUNTERS) + 2))
    return (
        f"INSERT INTO {table} ({columns}) VALUES ({placeholders}) "  # noqa: S608
        f"ON CONFLICT ({key}) DO UPDATE SET {updates}, "
        "ttft_ms_hist = tw_hist_add(ttft_ms_hist, excluded.ttft_ms_hist), "
        "tokens_per_s_hist = tw_hist_add(tokens_per_s_hist, excluded.tokens_per_s_hist)"
    )


_UPSERT = {granularity: upsert_sql(table, _KEY) for granularity, table in TABLES.items()}


def write(
    conn: sqlite3.Connection,
    increments: dict[Granularity, dict[AttrKey, Tally]],
    newest_ts: float,
) -> None:
    """Add a batch's increments (capped against what is stored) inside the open transaction,
    and drop hour cells past their retention."""
    for granularity, cells in increments.items():
        table = TABLES[granularity]

        def known(tenant: str | None, start: int, dimension: str, table: str = table) -> set[str]:
            sql = (
                f"SELECT value FROM {table} WHERE tenant = ? "  # noqa: S608
                "AND period_start = ? AND dimension = ?"
            )
            return {row[0] for row in conn.execute(sql, (tenant or "", start, dimension))}

        rows = [cell_row(key, tally) for key, tally in capped(cells, known).items()]
        conn.executemany(_UPSERT[granularity], rows)
    cutoff = int(newest_ts - HOUR_RETENTION_S)
    conn.execute(f"DELETE FROM {TABLES['hour']} WHERE period_start < ?", (cutoff,))  # noqa: S608


_BUCKET_SQL = {"hour": "period_start", "day": "period_start - period_start % 86400", None: "0"}
_SUMS_SQL = ", ".join(f"SUM({name})" for name in COUNTERS)


def read_cells(
    conn: sqlite3.Connection, granularity: Granularity, start: int, end: int, q: UsageQuery
) -> list[Cell]:
    """Cells of [start, end) for q's dimension, summed per (tenant, bucket, value)."""
    sql = (
        f"SELECT tenant, {_BUCKET_SQL[q.bucket]}, value, {_SUMS_SQL}, "  # noqa: S608
        "tw_hist_sum(ttft_ms_hist), tw_hist_sum(tokens_per_s_hist) "
        f"FROM {TABLES[granularity]} WHERE dimension = ? AND period_start >= ? "
        "AND period_start < ?"
    )
    params: tuple[object, ...] = (q.group_by, start, end)
    if q.tenant is not None:
        sql += " AND tenant = ?"
        params += (q.tenant,)
    return [_cell(row) for row in conn.execute(sql + " GROUP BY 1, 2, 3", params)]


def cell_row(key: tuple[str | int | None, ...], tally: Tally) -> tuple[object, ...]:
    """A cell as stored: its key (None as ''), its counters, its two histograms."""
    stored = tuple(part if isinstance(part, int) else part or "" for part in key)
    return (*stored, *tally.counters(), histogram.encode(tally.ttft_ms),
            histogram.encode(tally.tokens_per_s))  # fmt: skip


def tally_of(row: tuple[Any, ...], key_columns: int) -> Tally:
    """The totals of a summed row whose first `key_columns` columns are its key."""
    ttft, speed = row[key_columns + len(COUNTERS) :]
    # SQLite turns a total past int64 into a REAL: the integer nearest it (16 digits exact)
    counters = map(int, row[key_columns : key_columns + len(COUNTERS)])
    return Tally.from_counters(counters, histogram.decode(ttft), histogram.decode(speed))


def _cell(row: tuple[Any, ...]) -> Cell:
    tenant, start, value = row[:3]
    return Cell((tenant or None, start, value or None, None), tally_of(row, 3))
