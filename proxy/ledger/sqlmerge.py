"""A batch's increments added to the SQLite ledger's stored totals: one read for all four tables,
one write a table.

Blocking calls only, run inside the writer's open transaction.

Why not an upsert per cell: every statement step lets go of the GIL, and so does every call
SQLite makes into a Python function, and each time the writer thread must take the GIL back
from a busy event loop (about 50-150 µs of CPU, benchmarks.md "the ledger's writer"). Upserts
whose histograms SQLite merged by calling Python made some thirty such handoffs a batch. Here
the stored rows a batch adds to come back as one JSON document (one step), Python adds the
increments, and each table takes its new rows in one statement. BEGIN IMMEDIATE holds the
database's write lock from before the read, so no other writer (another worker's) changes a row
between the read and the write.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any

import orjson

from proxy.ledger import histogram, sqlattr
from proxy.ledger.aggregate import COUNTERS, Tally
from proxy.ledger.attribution import HOUR_RETENTION_S, OTHER, Folded, capped, tally_at

__all__ = ["write_totals"]

_CELL_KEY = ("tenant", "period_start", "model", "backend")
_ATTR_KEY = ("tenant", "period_start", "dimension", "value")
# (table, key columns), in the order of the read's parts 0-3
_TABLES = (
    ("usage_hour", _CELL_KEY),
    ("usage_day", _CELL_KEY),
    ("usage_hour_attr", _ATTR_KEY),
    ("usage_day_attr", _ATTR_KEY),
)
_HISTOGRAMS = ("ttft_ms_hist", "tokens_per_s_hist")
_WIDTH = len(_CELL_KEY) + len(COUNTERS) + len(_HISTOGRAMS)
# 999 bound values a statement: SQLite's limit before 3.32, still the limit of some builds
_ROWS_A_STATEMENT = 999 // _WIDTH

StoredKey = tuple[Any, ...]
"""A cell's key as stored, None as '': (tenant, period start, model, backend) or an AttrKey."""


def _matching(part: int, table: int, columns: int, whole: bool) -> str:
    """Part `part`: rows of _TABLES[table], each a JSON array of the part, the row's key, and if
    `whole` its counters and histograms (hex); a row matches when its first `columns` key
    columns are one of the entries of the JSON list bound to the part."""
    table_name, key = _TABLES[table]
    on = " AND ".join(
        f"t.{c} = json_extract(k.value, '$[{i}]')" for i, c in enumerate(key[:columns])
    )
    values = [f"t.{c}" for c in key]
    if whole:
        values += [f"t.{c}" for c in COUNTERS] + [f"hex(t.{h})" for h in _HISTOGRAMS]
    return (
        f"SELECT json_array({part}, {', '.join(values)}) AS found "  # noqa: S608 - names are ours
        f"FROM json_each(?) AS k CROSS JOIN {table_name} AS t ON {on}"
    )


# Parts 0-3: each table's rows the batch adds to; 4-5: every value already named in the
# attribution groups (tenant, period, dimension) the batch names a value in, for the cap.
_READ = (
    "SELECT json_group_array(json(found)) FROM ("  # noqa: S608 - names are ours
    + " UNION ALL ".join(
        [
            *(_matching(part, part, len(_CELL_KEY), whole=True) for part in range(4)),
            _matching(4, 2, len(_ATTR_KEY) - 1, whole=False),
            _matching(5, 3, len(_ATTR_KEY) - 1, whole=False),
        ]
    )
    + ")"
)


def write_totals(conn: sqlite3.Connection, folded: Folded, newest_ts: float) -> None:
    """Add a batch's folded increments to the hour and day totals (attribution capped against
    what is stored, as the upserts did), and drop attribution hour cells past their retention."""
    increments = [_stored_keys(cells.items()) for cells in folded]
    # the attribution groups the batch names a value in; a value past the cap goes to OTHER
    named = [{key[:3] for key in increments[part] if key[3] not in ("", OTHER)} for part in (2, 3)]
    wanted: list[Iterable[StoredKey]] = [
        *increments[:2],
        *([*increments[2 + i], *((*group, OTHER) for group in named[i])] for i in (0, 1)),
        *named,
    ]
    stored, known = _read(conn, wanted)
    for i in (0, 1):
        if named[i]:
            increments[2 + i] = capped(increments[2 + i], partial(_named, known[i]))
    for part, (table, _) in enumerate(_TABLES):
        rows = []
        for key, tally in increments[part].items():
            found = stored[part].get(key)
            if found is not None:
                found.merge(tally)
            rows.append(sqlattr.cell_row(key, tally if found is None else found))
        _replace(conn, table, rows)
    cutoff = int(newest_ts - HOUR_RETENTION_S)
    conn.execute("DELETE FROM usage_hour_attr WHERE period_start < ?", (cutoff,))


def _named(known: dict[StoredKey, set[str]], *group: str | int | None) -> set[str]:
    return known.get(group, set())


def _stored_keys(
    cells: Iterable[tuple[tuple[str | int | None, ...], Tally]],
) -> dict[StoredKey, Tally]:
    """Cells by their stored key (None as ''): cells whose keys differ only so are summed."""
    out: dict[StoredKey, Tally] = {}
    for key, tally in cells:
        stored = tuple(part if isinstance(part, int) else part or "" for part in key)
        tally_at(out, stored).merge(tally)
    return out


def _read(
    conn: sqlite3.Connection, wanted: Sequence[Iterable[StoredKey]]
) -> tuple[list[dict[StoredKey, Tally]], list[dict[StoredKey, set[str]]]]:
    """Each table's stored rows of the keys wanted (parts 0-3), and the values named in each
    attribution group wanted (parts 4-5), in one statement."""
    params = [orjson.dumps(list(keys)).decode() for keys in wanted]
    (document,) = conn.execute(_READ, params).fetchone()
    stored: list[dict[StoredKey, Tally]] = [{}, {}, {}, {}]
    known: list[dict[StoredKey, set[str]]] = [{}, {}]
    for part, *row in orjson.loads(document):
        key = tuple(row[: len(_CELL_KEY)])
        if part >= 4:
            known[part - 4].setdefault(key[:3], set()).add(key[3])
            continue
        counters = row[len(_CELL_KEY) : len(_CELL_KEY) + len(COUNTERS)]
        ttft, speed = (histogram.decode(bytes.fromhex(text)) for text in row[-2:])
        stored[part][key] = Tally.from_counters(counters, ttft, speed)
    return stored, known


_REPLACE: dict[tuple[str, int], str] = {}


def _replace(conn: sqlite3.Connection, table: str, rows: Sequence[tuple[object, ...]]) -> None:
    """`rows` written over any stored under their keys, up to _ROWS_A_STATEMENT a statement."""
    for done in range(0, len(rows), _ROWS_A_STATEMENT):
        chunk = rows[done : done + _ROWS_A_STATEMENT]
        sql = _REPLACE.get((table, len(chunk)))
        if sql is None:
            key = _TABLES[[t for t, _ in _TABLES].index(table)][1]
            columns = ", ".join((*key, *COUNTERS, *_HISTOGRAMS))
            one = f"({', '.join('?' * _WIDTH)})"
            sql = _REPLACE[(table, len(chunk))] = (
                f"INSERT OR REPLACE INTO {table} ({columns}) "  # noqa: S608 - names are ours
                f"VALUES {', '.join([one] * len(chunk))}"
            )
        conn.execute(sql, [value for row in chunk for value in row])
