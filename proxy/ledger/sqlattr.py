"""The SQLite ledger's totals by key, user and tag: their tables, rows and reads.

sqlmerge.py writes them, with the hour and day totals.

Blocking calls only, run inside the writer's transaction or a reader's `asyncio.to_thread`.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from proxy.ledger import histogram
from proxy.ledger.aggregate import COUNTERS, Cell, Granularity, Tally
from proxy.ledger.base import UsageQuery

__all__ = ["MIGRATION", "TABLES", "cell_row", "read_cells", "tally_of"]

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
    counters = row[key_columns : key_columns + len(COUNTERS)]
    return Tally.from_counters(counters, histogram.decode(ttft), histogram.decode(speed))


def _cell(row: tuple[Any, ...]) -> Cell:
    tenant, start, value = row[:3]
    return Cell((tenant or None, start, value or None, None), tally_of(row, 3))
