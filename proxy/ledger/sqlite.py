"""The SQLite ledger: appends buffered in memory, written by one thread in batched transactions.

sqlite3 blocks, so the event loop never touches it: the writer thread owns the write connection
and each query opens a read-only connection in `asyncio.to_thread` (WAL lets both run at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

from proxy.doze import Doze
from proxy.ledger import query as planner
from proxy.ledger import sqlschema
from proxy.ledger.aggregate import Cell
from proxy.ledger.base import LedgerError, UsageQuery, UsageRecord, UsageRow
from proxy.ledger.sqlfile import LedgerFile
from proxy.ledger.sqlprune import Pruner
from proxy.ledger.writer import BufferedLedger

__all__ = ["SqliteLedger"]

_T = TypeVar("_T")
_log = logging.getLogger("tokenweir.ledger")

# A locked or unwritable database, or none that can be opened at the path: wait and retry the
# batch (any other error is a record's).
_OUTAGES: tuple[type[BaseException], ...] = (sqlite3.OperationalError, LedgerError)


class SqliteLedger(BufferedLedger):
    """`append` is a deque append; the thread commits every `interval_s` or `batch_records`.
    After an interval with nothing to write it sleeps until a record comes and commits it at
    once; the interval then batches those that follow.

    A backlog (after a burst or an outage) is written `transaction_records` at a time: bigger
    transactions fold more records into each aggregate row, so the writer catches up faster.
    With `keep_records_s`, raw records older are deleted between batches (sqlprune.py).
    A file deleted or replaced at `path` while it runs is let go for the one there (sqlfile.py).
    A WAL grown past `wal_keep_bytes` (a long reader held checkpoints back) is cut back to it.
    """

    def __init__(
        self,
        path: Path,
        *,
        read_only: bool = False,
        batch_records: int = 500,
        transaction_records: int = 5000,
        interval_s: float = 0.05,
        buffer_records: int = 100_000,
        flush_timeout_s: float = 10.0,
        busy_timeout_s: float = 5.0,
        keep_records_s: float | None = None,
        wal_keep_bytes: int = 64 << 20,
        read_timeout_s: float = 30.0,
    ) -> None:
        self._wake = threading.Event()
        self._dozing = Doze()
        super().__init__(
            read_only=read_only, batch_records=batch_records, buffer_records=buffer_records,
            flush_timeout_s=flush_timeout_s, wake=self._wake, doze=self._dozing,
        )  # fmt: skip
        self.path = path
        self._transaction_records = transaction_records
        self._interval_s = interval_s
        self._busy_timeout_s = busy_timeout_s
        self._read_timeout_s = read_timeout_s
        self._thread: threading.Thread | None = None
        self._file = LedgerFile(  # the writer thread's own
            path, busy_timeout_s=busy_timeout_s, wal_keep_bytes=wal_keep_bytes
        )
        self._prune = None if keep_records_s is None else Pruner(keep_records_s)

    def _writer_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _where(self) -> str:
        return str(self.path)

    async def _join_writer(self) -> None:
        """Wait for the writer's last drain, as long as a flush at most: a write the file system
        never answers (frozen, hung) would keep the gateway from exiting for as long."""
        if self._thread is None:
            return
        await asyncio.to_thread(self._thread.join, self._flush_timeout_s)
        if self._thread.is_alive():  # a daemon thread: the process may exit without it
            _log.error(
                "the ledger writer is still waiting on %s after %gs (its file system frozen "
                "or hung?): the gateway stops without it",
                self.path,
                self._flush_timeout_s,
            )

    async def start(self) -> None:
        if self._read_only:
            await asyncio.to_thread(self._check_readable)
            return
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="tokenweir-ledger", daemon=True
        )
        self._thread.start()
        await ready

    async def query(self, q: UsageQuery) -> list[UsageRow]:
        cells = await self._off_loop(partial(self._read_cells, q))
        return planner.rows(q, cells)

    async def latest(self, tenant: str | None, limit: int) -> list[UsageRecord]:
        return await self._off_loop(partial(self._read_latest, tenant, limit))

    async def _off_loop(self, read: Callable[[], _T]) -> _T:
        """`read` in a thread, given up on after `read_timeout_s`: a file system frozen or hung
        (fsfreeze, a lost NFS server) blocks it in the kernel, and /api/usage with it."""
        try:
            async with asyncio.timeout(self._read_timeout_s):
                return await asyncio.to_thread(read)
        except TimeoutError:
            raise LedgerError(
                f"no answer from the ledger database {self.path} within "
                f"{self._read_timeout_s:g}s (its file system frozen or hung?)"
            ) from None

    def _run(self, ready: asyncio.Future[None]) -> None:
        loop = ready.get_loop()
        try:
            self._file.open()
        except LedgerError as exc:
            loop.call_soon_threadsafe(_settle, ready, exc)
            return
        except BaseException as exc:  # start() must never wait for a thread that died
            failed = LedgerError(f"the ledger writer failed to start: {exc!r}")
            loop.call_soon_threadsafe(_settle, ready, failed)
            raise
        loop.call_soon_threadsafe(_settle, ready, None)
        try:
            while not self._stopping:
                self._wake.wait(self._interval_s)  # unless a batch fills, or a flush asks
                self._wake.clear()
                if not self._has_work():  # a whole interval without a record: doze until
                    self._dozing.until(self._has_work)  # one comes (or close), written at once
                self._drain()
                self._pruned()
            self._drain()  # anything appended after the last flush
        finally:
            self._file.close()

    def _drain(self) -> None:
        """Write until the buffer is empty; on an outage wait (interruptibly) and try again.

        A batch that fails for any other reason (a value SQLite cannot bind) is written again
        a record at a time, so only the record at fault is dropped, not its whole batch.
        """
        attempt = 0
        while (batch := self._buffer.next_batch(self._transaction_records)) is not None:
            try:
                try:
                    self._file.write(batch.records)
                except _OUTAGES:
                    raise
                except Exception:  # any other failure: find the record at fault
                    self._buffer.isolate(self._file.write, _OUTAGES)
                else:
                    self._buffer.succeeded()
            except _OUTAGES as exc:
                delay_s = self._buffer.failed(exc, attempt)
                attempt += 1
                if self._stopping:
                    return
                self._wake.wait(delay_s)
                self._wake.clear()
            else:
                attempt = 0

    def _pruned(self) -> None:
        """Prune the file now at the path, if one can be opened (else at a later batch)."""
        if self._prune is not None:
            with contextlib.suppress(LedgerError):
                self._prune(self._file.open())

    def _check_readable(self) -> None:
        if not self.path.is_file():
            raise LedgerError(f"there is no ledger database at {self.path}")
        sqlschema.connect(self.path, busy_timeout_s=self._busy_timeout_s, writer=False).close()

    def _read_cells(self, q: UsageQuery) -> list[Cell]:
        conn = self._reader()
        try:
            return [
                cell for span in planner.plan(q) for cell in sqlschema.read_cells(conn, span, q)
            ]
        except sqlite3.Error as exc:
            raise LedgerError(f"cannot read the ledger database {self.path}: {exc}") from exc
        finally:
            conn.close()

    def _read_latest(self, tenant: str | None, limit: int) -> list[UsageRecord]:
        conn = self._reader()
        try:
            return sqlschema.read_latest(conn, tenant, limit)
        except sqlite3.Error as exc:
            raise LedgerError(f"cannot read the ledger database {self.path}: {exc}") from exc
        finally:
            conn.close()

    def _reader(self) -> sqlite3.Connection:
        return sqlschema.connect(self.path, busy_timeout_s=self._busy_timeout_s, writer=False)


def _settle(future: asyncio.Future[None], error: LedgerError | None) -> None:
    if future.done():  # start() was cancelled
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
