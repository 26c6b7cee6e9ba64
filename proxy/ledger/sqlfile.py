"""The SQLite ledger writer's connection to the file at its path, opened again when that file is
deleted, renamed or replaced while the gateway runs (SQLite would go on writing to the old one).

Blocking calls only: the ledger's writer thread alone uses it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from proxy.ledger import sqlschema
from proxy.ledger.base import LedgerError, UsageRecord

__all__ = ["LedgerFile"]

_log = logging.getLogger("tokenweir.ledger")


class LedgerFile:
    """Writes batches to the ledger file now at `path`, checking before each (one `stat`) that it
    is still the file the connection has open. An open file that is no longer there is
    checkpointed (a renamed file keeps every record written to it) and let go; the next batch
    goes to the file at the path, created and migrated if none is there, and waits, kept, while
    none can be opened (a foreign file, a missing directory): the error is an outage's.
    """

    def __init__(self, path: Path, *, busy_timeout_s: float, wal_keep_bytes: int) -> None:
        self.path = path
        self._busy_timeout_s = busy_timeout_s
        self._wal_keep_bytes = wal_keep_bytes
        self._conn: sqlite3.Connection | None = None
        self._identity: tuple[int, int] | None = None
        # Each running request's checkpoint (its link) -> its raw row in the open file, updated
        # only once a transaction commits (sqlschema.write_batch).
        self._checkpoints: dict[str, int] = {}
        # Links whose checkpoint is in a file let go: the request's next record replaces nothing
        # in the file now open, whose totals never had it.
        self._elsewhere: set[str] = set()

    def open(self) -> sqlite3.Connection:
        """The connection to the file at the path; raises LedgerError when none can be opened."""
        if self._conn is not None and self._identity == _identity(self.path):
            return self._conn
        if self._conn is not None:
            self._let_go(self._conn)
        conn = sqlschema.connect(
            self.path, busy_timeout_s=self._busy_timeout_s, writer=True,
            wal_keep_bytes=self._wal_keep_bytes,
        )  # fmt: skip
        identity = _identity(self.path)
        if identity is None:  # gone again already: write nothing to a file nobody will find
            conn.close()
            raise LedgerError(f"the ledger database {self.path} was deleted as it was opened")
        self._conn, self._identity = conn, identity
        return conn

    def write(self, records: Sequence[UsageRecord]) -> None:
        """`records` and their totals, in one transaction, in the file at the path."""
        conn = self.open()
        if self._elsewhere:
            records = self._relinked(records)
        try:
            sqlschema.write_batch(conn, records, self._checkpoints)
        except sqlite3.DatabaseError as exc:
            if type(exc) is not sqlite3.DatabaseError:  # a subclass: a record's fault, or an
                raise  # outage's (OperationalError), which the ledger tells apart
            # Corrupt, or no database any more: the file's fault, not the records'. They wait
            # for a file to take them, as for a full disk (moving this one away gives one).
            raise LedgerError(
                f"the ledger database {self.path} cannot be written ({exc}): move it away "
                "and the records kept go to a new file at that path"
            ) from exc
        if self._elsewhere:
            self._elsewhere.difference_update(r.link for r in records)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _let_go(self, conn: sqlite3.Connection) -> None:
        _log.error(
            "the ledger database %s was deleted or replaced while the gateway wrote to it: "
            "records now go to the file at that path",
            self.path,
        )
        # SQLite does not checkpoint a moved file at close: its WAL would stay, named after the
        # path, to be paired with the next file there (or deleted, the file there being new).
        with contextlib.suppress(sqlite3.Error):
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.close()
        self._conn = self._identity = None
        self._elsewhere.update(self._checkpoints)
        self._checkpoints.clear()

    def _relinked(self, records: Sequence[UsageRecord]) -> list[UsageRecord]:
        """`records`, a request's first one since its checkpoint's file was let go replacing
        nothing (those after it replace the checkpoint it is, or follows, in this batch)."""
        elsewhere = set(self._elsewhere)
        relinked = []
        for record in records:
            superseded = record.supersedes
            if superseded is not None and superseded.link in elsewhere:
                record = replace(record, supersedes=None)
            elsewhere.discard(record.link)
            relinked.append(record)
        return relinked


def _identity(path: Path) -> tuple[int, int] | None:
    """Which file is at `path` (device and inode), or None when there is none."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino
