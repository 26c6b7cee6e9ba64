"""The direct span path's batch processor: encoded spans queued, posted in batches by one thread.

It follows the SDK's BatchSpanProcessor and reads the same variables: every
`OTEL_BSP_SCHEDULE_DELAY` ms (default 5000), or as soon as `OTEL_BSP_MAX_EXPORT_BATCH_SIZE`
spans (512) wait, it posts them, at most that many a batch; at most `OTEL_BSP_MAX_QUEUE_SIZE`
spans (2048) wait, and a request whose spans do not fit is dropped whole, counted and logged
(the SDK drops the oldest span instead); one export may take `OTEL_BSP_EXPORT_TIMEOUT` ms
(30000) with its retries, or the OTLP timeout if shorter, and spans it could not post are
counted too (`dropped`, shown on /metrics). `shutdown` posts what is left.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from proxy.telemetry.forks import call_in_forked_child

__all__ = ["BatchSettings", "Sender", "SpanBatcher", "batch_settings"]

_log = logging.getLogger("tokenweir")


class Sender(Protocol):
    def send(self, body: bytes, spans: int, timeout_s: float | None = None) -> bool: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class BatchSettings:
    schedule_delay_s: float = 5.0
    max_queue_size: int = 2048
    max_export_batch_size: int = 512
    export_timeout_s: float = 30.0


def batch_settings(environ: Mapping[str, str]) -> BatchSettings:
    """OTEL_BSP_*, with the SDK's defaults for a value that is not an integer and its errors
    for sizes that cannot work."""
    settings = BatchSettings(
        _ms(environ, "OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000.0,
        _ms(environ, "OTEL_BSP_MAX_QUEUE_SIZE", 2048),
        _ms(environ, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512),
        _ms(environ, "OTEL_BSP_EXPORT_TIMEOUT", 30000) / 1000.0,
    )
    if settings.max_queue_size <= 0 or settings.max_export_batch_size <= 0:
        raise ValueError("OTEL_BSP_MAX_QUEUE_SIZE and _MAX_EXPORT_BATCH_SIZE must be positive")
    if settings.schedule_delay_s <= 0:
        raise ValueError("OTEL_BSP_SCHEDULE_DELAY must be positive")
    if settings.max_export_batch_size > settings.max_queue_size:
        raise ValueError("OTEL_BSP_MAX_EXPORT_BATCH_SIZE must be at most OTEL_BSP_MAX_QUEUE_SIZE")
    return settings


def _ms(environ: Mapping[str, str], name: str, default: int) -> int:
    text = environ.get(name)
    try:
        return default if text is None else int(text)
    except ValueError:
        _log.warning("%s=%r is not an integer: %d", name, text, default)
        return default


class SpanBatcher:
    """`add` is called by the gateway's event loop (one thread: the queue bound is checked
    without a lock); one thread of its own posts."""

    def __init__(
        self, frame: Callable[[Sequence[bytes]], bytes], sender: Sender, settings: BatchSettings
    ) -> None:
        self._frame = frame
        self._sender = sender
        self._settings = settings
        self._batch = settings.max_export_batch_size
        self._limit = settings.max_queue_size
        self._timeout_s = settings.export_timeout_s
        self._queue: deque[bytes] = deque()
        self.dropped_spans = 0  # the queue was full (counted on the event loop)
        self.failed_spans = 0  # their post failed (counted by the posting thread)
        self._logged_drops = 0
        self._stopping = False
        self._start_thread()
        call_in_forked_child(self._start_thread)

    def _start_thread(self) -> None:
        self._queue.clear()  # in a forked child: the parent's spans are the parent's to post
        self._exporting = threading.Lock()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenweir-spans", daemon=True)
        self._thread.start()

    def add(self, spans: list[bytes]) -> None:
        """Queue one request's spans, or drop them all if they do not fit."""
        queue = self._queue
        if len(queue) + len(spans) > self._limit or self._stopping:
            self.dropped_spans += len(spans)
            return
        queue.extend(spans)
        if len(queue) >= self._batch and not self._wake.is_set():
            self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            woken = self._wake.wait(self._settings.schedule_delay_s)
            self._wake.clear()
            if self._stopping:
                break
            self._export(partial=not woken)
        self._export(partial=True, everything=True)

    def _export(self, partial: bool, everything: bool = False) -> None:
        """Post full batches while there are any; first one partial batch if `partial`, and
        every span left if `everything`."""
        with self._exporting:
            while True:
                spans = self._take(partial or everything)
                if not spans:
                    break
                try:
                    sent = self._sender.send(self._frame(spans), len(spans), self._timeout_s)
                except Exception:  # this thread's outermost handler: it must go on posting
                    _log.exception("posting %d spans failed", len(spans))
                    sent = False
                if not sent:
                    self.failed_spans += len(spans)
                partial = False
            self._report_drops()

    def _take(self, partial: bool) -> list[bytes]:
        queue = self._queue
        if not queue or (not partial and len(queue) < self._batch):
            return []
        popleft = queue.popleft
        return [popleft() for _ in range(min(self._batch, len(queue)))]

    def _report_drops(self) -> None:
        dropped = self.dropped_spans
        if dropped > self._logged_drops:
            _log.warning(
                "dropped %d spans: the queue (OTEL_BSP_MAX_QUEUE_SIZE=%d) was full",
                dropped - self._logged_drops,
                self._limit,
            )
            self._logged_drops = dropped

    def dropped(self) -> dict[str, int]:
        """The spans lost so far, by why: `queue_full` or `export_failed`."""
        return {"queue_full": self.dropped_spans, "export_failed": self.failed_spans}

    def flush(self) -> None:
        """Post every span queued now, from the calling thread."""
        self._export(partial=True, everything=True)

    def shutdown(self) -> None:
        """Post what is left (within the export timeout), then stop; later spans are dropped."""
        if self._stopping:
            return
        self._stopping = True
        self._wake.set()
        self._thread.join(self._timeout_s)
        self._sender.close()
