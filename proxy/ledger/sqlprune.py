"""A SQLite ledger's raw records older than its `keep_records` (`sqlite:///x.db?keep_records=90d`)
deleted by its writer thread, a bounded number per transaction so that appends never wait long;
the hour and day totals, which reports, `/api/usage` and the dashboard read, are kept.

Records are appended as requests end, so their ids follow their end times, and a record's `ts`
is its request's start: a long stream's record comes after shorter requests that started later.
A prune deletes every record before the first one whose `ts` is inside the window: it never
deletes a record younger than `keep_records`, and an older one at most one request's length late.
"""

from __future__ import annotations

import logging
import sqlite3
import time

__all__ = ["Pruner"]

_CHUNK = 5000  # records a transaction deletes: a few milliseconds of the write lock
_FIRST_KEPT = "SELECT id FROM usage_records WHERE ts >= ? ORDER BY id LIMIT 1"
_BOUNDS = "SELECT min(id), max(id) FROM usage_records"
_DELETE_BEFORE = "DELETE FROM usage_records WHERE id < ?"
_log = logging.getLogger("tokenweir.ledger")


class Pruner:
    """Prunes when called at least `keep_s / 10` (at most an hour) after its last prune; the
    first call prunes. Runs on the writer thread, between its batches."""

    __slots__ = ("_every_s", "_keep_s", "_next_s")

    def __init__(self, keep_s: float) -> None:
        self._keep_s = keep_s
        self._every_s = min(3600.0, keep_s / 10)
        self._next_s = 0.0

    def __call__(self, conn: sqlite3.Connection, now: float | None = None) -> int:
        """Delete what is due, if a prune is due; the records deleted. A failure (a locked
        database) is logged and tried again at the next prune: the records wait, none is lost."""
        now = time.time() if now is None else now
        if now < self._next_s:
            return 0
        self._next_s = now + self._every_s
        try:
            deleted = prune(conn, now - self._keep_s)
        except sqlite3.Error as exc:
            _log.warning("ledger: could not delete raw records past keep_records: %s", exc)
            return 0
        if deleted:
            _log.info("ledger: deleted %d raw records past keep_records", deleted)
        return deleted


def prune(conn: sqlite3.Connection, before_ts: float, chunk: int = _CHUNK) -> int:
    """Delete the raw records before the first one whose request started at or after
    `before_ts` (all of them if none did), `chunk` at a time; the number deleted."""
    oldest, newest = conn.execute(_BOUNDS).fetchone()
    if oldest is None:
        return 0
    kept = conn.execute(_FIRST_KEPT, (before_ts,)).fetchone()
    end = kept[0] if kept is not None else newest + 1
    deleted = 0
    for upto in range(oldest + chunk, end + chunk, chunk):
        conn.execute("BEGIN IMMEDIATE")
        try:
            deleted += conn.execute(_DELETE_BEFORE, (min(upto, end),)).rowcount
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    return deleted
