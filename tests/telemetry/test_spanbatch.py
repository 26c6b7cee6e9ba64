"""Batching as OTEL_BSP_* say: batch sizes, the schedule, the queue bound, the flush at shutdown."""

from __future__ import annotations

import logging
import threading

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from proxy.telemetry.otlppost import OtlpPoster
from proxy.telemetry.spanbatch import BatchSettings, SpanBatcher, batch_settings
from proxy.telemetry.spanwire import (
    LOCAL_PARENT,
    SERVER,
    UNSET,
    SpanFrame,
    framed_span,
    span_head,
    span_ids,
)
from tests.redis_server import wait_until
from tests.telemetry.collector import collector

FRAME = SpanFrame({"service.name": "tokenweir"}, ("tokenweir", "1"))


def request_spans(number: int, count: int = 2) -> list[bytes]:
    """`count` spans of request `number` (its trace id)."""
    trace = span_ids(number + 1, "")
    return [
        framed_span(trace, i + 1, 0, span_head(f"span {number}.{i}", SERVER), 1, 2, b"", UNSET,
                    LOCAL_PARENT)
        for i in range(count)
    ]  # fmt: skip


class Recorder:
    """A Sender that keeps each batch's span names; `hold` makes it wait before taking one."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()

    def send(self, body: bytes, spans: int, timeout_s: float | None = None) -> bool:
        self.entered.set()
        self.hold.wait(10)
        request = ExportTraceServiceRequest.FromString(body)
        names = [s.name for r in request.resource_spans for ss in r.scope_spans for s in ss.spans]
        assert len(names) == spans
        self.batches.append(names)
        return True

    def close(self) -> None:
        pass


def batcher(
    sender: Recorder, *, delay_s: float = 60.0, queue: int = 2048, batch: int = 512
) -> SpanBatcher:
    return SpanBatcher(FRAME.body, sender, BatchSettings(delay_s, queue, batch, 5.0))


def test_a_full_batch_goes_at_once_and_none_is_larger_than_the_limit() -> None:
    sender = Recorder()
    spans = batcher(sender, batch=4)
    for number in range(5):  # 10 spans: two full batches go without waiting for the schedule
        spans.add(request_spans(number))
    wait_until(lambda: sum(map(len, sender.batches)) >= 8, "two full batches")
    spans.shutdown()  # and the last two at shutdown
    assert [len(b) for b in sender.batches] == [4, 4, 2]
    names = [name for b in sender.batches for name in b]
    assert names == [f"span {n}.{i}" for n in range(5) for i in range(2)]


def test_fewer_spans_than_a_batch_go_on_the_schedule() -> None:
    sender = Recorder()
    spans = batcher(sender, delay_s=0.05)
    spans.add(request_spans(0))
    wait_until(lambda: bool(sender.batches), "the scheduled batch")
    assert sender.batches == [["span 0.0", "span 0.1"]]
    spans.shutdown()


def test_a_full_queue_drops_whole_requests_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    sender = Recorder()
    sender.hold.clear()
    spans = batcher(sender, queue=6, batch=6)
    for number in range(3):  # a full batch: taken by the thread, which then waits in send()
        spans.add(request_spans(number))
    assert sender.entered.wait(10)
    for number in range(3, 7):  # 8 spans for a queue of 6: the last request does not fit
        spans.add(request_spans(number))
    assert spans.dropped_spans == 2
    with caplog.at_level(logging.WARNING, logger="tokenweir"):
        sender.hold.set()
        spans.shutdown()
    names = [name for b in sender.batches for name in b]
    assert names == [f"span {n}.{i}" for n in range(6) for i in range(2)]
    assert "dropped 2 spans: the queue (OTEL_BSP_MAX_QUEUE_SIZE=6) was full" in caplog.text


def test_shutdown_posts_what_is_left_to_a_real_collector() -> None:
    with collector() as server:
        endpoint = f"http://127.0.0.1:{server.server_port}"
        poster = OtlpPoster({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint})
        spans = SpanBatcher(FRAME.body, poster, BatchSettings(60.0, 100, 50, 5.0))
        for number in range(3):
            spans.add(request_spans(number, count=3))
        assert server.spans() == []  # the schedule is a minute away
        spans.shutdown()
        spans.add(request_spans(9))  # after shutdown: dropped
        [(headers, request)] = server.spans()
    assert headers["content-type"] == "application/x-protobuf"
    [resource_spans] = request.resource_spans
    assert resource_spans.resource.attributes[0].value.string_value == "tokenweir"
    [scope_spans] = resource_spans.scope_spans
    assert (scope_spans.scope.name, scope_spans.scope.version) == ("tokenweir", "1")
    assert len(scope_spans.spans) == 9
    assert spans.dropped_spans == 2


def test_settings_follow_the_sdk() -> None:
    assert batch_settings({}) == BatchSettings(5.0, 2048, 512, 30.0)
    assert batch_settings({
        "OTEL_BSP_SCHEDULE_DELAY": "250", "OTEL_BSP_MAX_QUEUE_SIZE": "100",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "10", "OTEL_BSP_EXPORT_TIMEOUT": "2000",
    }) == BatchSettings(0.25, 100, 10, 2.0)  # fmt: skip
    assert batch_settings({"OTEL_BSP_MAX_QUEUE_SIZE": "lots"}).max_queue_size == 2048
    with pytest.raises(ValueError, match="at most"):
        batch_settings({"OTEL_BSP_MAX_QUEUE_SIZE": "10", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "11"})
    with pytest.raises(ValueError, match="positive"):
        batch_settings({"OTEL_BSP_SCHEDULE_DELAY": "0"})
