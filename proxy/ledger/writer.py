"""What every ledger shares: appends into a buffer, a background writer, flush and close."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol

from proxy.ledger.base import LedgerError, LedgerStats, UsageRecord, bounded
from proxy.ledger.buffer import RecordBuffer

__all__ = ["BufferedLedger"]


class _Wake(Protocol):
    def set(self) -> None: ...


class _Doze(Protocol):
    def wake(self) -> None: ...


class BufferedLedger:
    """`append` is a deque append; a subclass's writer (a thread or a task) drains the buffer.

    Subclasses say whether their writer runs, where records go (for messages), how to wait for
    the writer to stop, and what to release afterwards.
    """

    def __init__(
        self,
        *,
        read_only: bool,
        batch_records: int,
        buffer_records: int,
        flush_timeout_s: float,
        wake: _Wake,
        doze: _Doze,
    ) -> None:
        self._read_only = read_only
        self._batch_records = batch_records
        self._flush_timeout_s = flush_timeout_s
        self._buffer = RecordBuffer(max_records=buffer_records)
        self._signal = wake  # a full batch, a flush or close: write now
        # After an interval with nothing to write, the writer dozes until a record comes.
        self._doze = doze
        self._stopping = False
        self._closed = False

    def append(self, record: UsageRecord) -> None:
        if self._read_only:
            raise LedgerError("this ledger was opened read-only")
        queued = self._buffer.put(bounded(record))
        if queued == 1:
            self._doze.wake()
        if queued == self._batch_records:  # crossings, not every append
            self._signal.set()

    def _has_work(self) -> bool:
        """Something for the writer to do: records to write, or the end."""
        return bool(self._buffer.buffered) or self._stopping

    def stats(self) -> LedgerStats:
        return self._buffer.stats()

    async def evicting(self) -> str | None:
        return None

    async def flush(self) -> None:
        durable = self._buffer.wait_durable()
        if durable.done():
            return
        if not self._writer_running():
            durable.cancel()
            raise LedgerError(f"{self._buffer.buffered} ledger records wait for a writer")
        self._signal.set()
        try:
            async with asyncio.timeout(self._flush_timeout_s):
                await durable
        except TimeoutError:
            raise LedgerError(
                f"{self._buffer.buffered} ledger records not yet written to {self._where()} "
                f"after {self._flush_timeout_s:g}s: {self._buffer.stats().last_error}"
            ) from None

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(LedgerError):  # whatever stays unwritten is logged below
            await self.flush()
        self._buffer.close()  # the writer's last drain takes what came in during the flush
        self._stopping = True
        self._signal.set()
        self._doze.wake()
        await self._join_writer()
        self._buffer.report_unwritten()
        await self._release()

    def _writer_running(self) -> bool:
        raise NotImplementedError

    def _where(self) -> str:
        raise NotImplementedError

    async def _join_writer(self) -> None:
        raise NotImplementedError

    async def _release(self) -> None:
        return None
