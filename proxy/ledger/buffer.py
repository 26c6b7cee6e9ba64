"""The bounded in-memory queue between `append` and a ledger's background writer.

It owns the batch being written (kept, unchanged, until a write succeeds), the counters behind
`stats()`, the retry backoff and its log lines, and the futures that `flush()` waits on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from proxy.ledger.base import LedgerStats, UsageRecord

__all__ = ["Batch", "RecordBuffer"]

_log = logging.getLogger("tokenweir.ledger")


@dataclass(frozen=True, slots=True)
class Batch:
    """`seq` grows by one per new batch of a writer; a retried batch keeps its seq and records."""

    seq: int
    records: list[UsageRecord]


class RecordBuffer:
    """`put` runs on the event loop; `next_batch`, `succeeded`, `failed` on the one writer."""

    def __init__(self, *, max_records: int, retry_max_s: float = 5.0) -> None:
        self._queue: deque[UsageRecord] = deque()
        self._max_records = max_records
        self._closed = False
        self._retry_max_s = retry_max_s
        self._pending: Batch | None = None
        self._seq = 0
        self._accepted = 0
        self._settled = 0
        self._written = 0
        self._dropped = 0
        self._dropped_reported = 0
        self._discarded = 0
        self._failures = 0
        self._failing_since: int | None = None
        self._last_error: str | None = None
        self._lock = threading.Lock()
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        # A running request whose last checkpoint was dropped (by its link): the checkpoint
        # the ledger holds for it instead, which the request's next record supersedes.
        self._held: dict[str, UsageRecord | None] = {}

    def put(self, record: UsageRecord) -> int:
        """Queue `record`; returns the queue length, or -1 when the record was dropped."""
        queue = self._queue
        if self._held and record.supersedes is not None:
            record = self._relink(record)
        if len(queue) >= self._max_records:
            self._drop()
            if record.checkpoint:  # the request's checkpoint before it stays the one held
                self._held[record.link] = record.supersedes
            return -1
        queue.append(record)
        self._accepted += 1
        return len(queue)

    def _relink(self, record: UsageRecord) -> UsageRecord:
        """`record`, superseding the checkpoint the ledger holds, not a dropped one it never saw
        (the totals would lose the dropped one's share, which they never had)."""
        link = record.link
        if link not in self._held:
            return record
        return replace(record, supersedes=self._held.pop(link))

    def next_batch(self, max_records: int) -> Batch | None:
        """The batch to write now: the one that failed last time, else up to `max_records` new."""
        if self._pending is None and self._queue:
            take = min(max_records, len(self._queue))
            popleft = self._queue.popleft
            self._seq += 1
            self._pending = Batch(self._seq, [popleft() for _ in range(take)])
        return self._pending

    def succeeded(self) -> None:
        batch = self._pending
        if batch is None:
            return
        self._pending = None
        self._written += len(batch.records)
        if self._failing_since is not None:
            _log.warning(
                "ledger writes recovered after %d failed attempts",
                self._failures - self._failing_since,
            )
            self._failing_since = None
        self._report_drops()
        self._settle(len(batch.records))

    def failed(self, error: BaseException, attempt: int) -> float:
        """Count and log a failed write; returns how long to wait before the retry."""
        self._failures += 1
        self._last_error = f"{type(error).__name__}: {error}"
        if self._failing_since is None:
            self._failing_since = self._failures - 1
            _log.error(
                "ledger write failed, %d records kept and retried: %s",
                self.buffered,
                self._last_error,
            )
        return min(self._retry_max_s, 0.05 * 2.0 ** min(attempt, 16))

    def isolate(
        self,
        write: Callable[[list[UsageRecord]], None],
        transient: tuple[type[BaseException], ...],
    ) -> None:
        """Write the pending batch one record at a time, after it failed whole for a reason
        that is not an outage: a record that cannot be written is dropped (counted, logged),
        the others are written. A `transient` error stops it; the unwritten rest stays pending.
        """
        batch = self._pending
        if batch is None:
            return
        for index, record in enumerate(batch.records):
            try:
                write([record])
            except transient:
                self._pending = Batch(batch.seq, batch.records[index:])
                self._settle(index)
                raise
            except Exception as exc:  # this record's fault: drop it alone
                self._discarded += 1
                _log.error("ledger dropped a record it cannot write: %r", exc)
            else:
                self._written += 1
        self._pending = None
        self._settle(len(batch.records))

    def discard(self, error: BaseException) -> None:
        """Give up on the pending batch (a bug, not an outage): count it dropped, log, go on."""
        batch = self._pending
        if batch is None:
            return
        self._pending = None
        self._discarded += len(batch.records)
        _log.error("ledger dropped %d records it cannot encode", len(batch.records), exc_info=error)
        self._settle(len(batch.records))

    def wait_durable(self) -> asyncio.Future[None]:
        """A future that completes once every record accepted so far is settled."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        target = self._accepted
        with self._lock:
            if self._settled >= target:
                future.set_result(None)
            else:
                self._waiters.append((target, future))
        return future

    @property
    def buffered(self) -> int:
        pending = self._pending
        return len(self._queue) + (len(pending.records) if pending else 0)

    def stats(self) -> LedgerStats:
        return LedgerStats(
            appended=self._accepted,
            written=self._written,
            dropped=self._dropped + self._discarded,
            buffered=self.buffered,
            write_failures=self._failures,
            last_error=self._last_error,
        )

    def close(self) -> None:
        """Accept nothing more: a record appended after the ledger closed is counted as dropped."""
        self._closed = True
        self._max_records = 0

    def report_unwritten(self) -> None:
        """At close: log what could not be written, and why; it is lost with the process."""
        if self.buffered:
            _log.error(
                "ledger closed with %d records not written (lost): %s",
                self.buffered,
                self._last_error,
            )

    def _drop(self) -> None:
        if self._dropped == self._dropped_reported:
            if self._closed:
                _log.error("ledger closed: dropping records appended after aclose()")
            else:
                _log.error(
                    "ledger buffer full (%d records): dropping new records until writes catch up",
                    self._max_records,
                )
        self._dropped += 1

    def _report_drops(self) -> None:
        dropped = self._dropped - self._dropped_reported
        if dropped and len(self._queue) < self._max_records:
            self._dropped_reported = self._dropped
            _log.error("ledger dropped %d records while its buffer was full", dropped)

    def _settle(self, count: int) -> None:
        with self._lock:
            self._settled += count
            ready = [f for target, f in self._waiters if target <= self._settled]
            self._waiters = [(t, f) for t, f in self._waiters if t > self._settled]
        for future in ready:
            _resolve_soon(future)


def _resolve_soon(future: asyncio.Future[None]) -> None:
    """Complete `future` on its own loop, from whichever thread the writer runs on."""
    loop = future.get_loop()
    try:
        loop.call_soon_threadsafe(_resolve, future)
    except RuntimeError:  # its loop is closed: nobody is waiting any more
        pass


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
