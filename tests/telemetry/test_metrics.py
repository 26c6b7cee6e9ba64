"""What /metrics shows for a stream's gaps between tokens: each in the bucket its value names."""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from proxy.clock import FakeClock
from proxy.telemetry.metrics import GatewayMetrics
from proxy.telemetry.sample import RequestSample
from proxy.telemetry.semconv import CHUNK_S
from proxy.upstream.meter import StreamMeter

LABELS = ("alpha", "chat", "mock-llm", "mock", "2xx")
FAMILY = "gen_ai_client_operation_time_per_output_chunk_seconds"


def _sample(meter: StreamMeter) -> RequestSample:
    return RequestSample(
        labels=LABELS, input_tokens=10, output_tokens=meter.texted_events, cost_nusd=0,
        duration_s=1.0, gateway_s=0.001, upstream_s=1.0, upstream_ttft_s=0.01, ttft_s=0.02,
        time_per_token_s=None, gaps=meter.gaps, cache="miss", saved_tokens=(0, 0),
        saved_nusd=0, rejected=None, degraded=(), error_type=None,
    )  # fmt: skip


def _buckets(text: bytes) -> dict[str, float]:
    return {
        sample.labels["le"]: sample.value
        for family in text_string_to_metric_families(text.decode())
        if family.name == FAMILY
        for sample in family.samples
        if sample.name == FAMILY + "_bucket"
    }


def test_every_gap_is_counted_under_the_bounds_its_value_is_within() -> None:
    """Tokens written at gaps on either side of each boundary (a stall of 2.55 s was shown as
    at most 2.5 s, a 10.4 ms gap as at most 10 ms: the meter's log buckets were folded into
    the histogram's by their middles)."""
    gaps = [
        gap
        for bound in CHUNK_S
        for gap in (
            bound * 0.96,
            bound,
            math.nextafter(bound, math.inf),
            bound * 1.02,
            bound * 1.04,
        )
    ]
    clock = FakeClock()
    meter = StreamMeter(clock.monotonic())
    meter.wrote(clock.monotonic(), 1, True)
    written = []
    for gap in gaps:
        before = clock.monotonic()
        clock.advance(gap)
        meter.wrote(clock.monotonic(), 1, True)
        written.append(clock.monotonic() - before)  # the gap as the clock's floats make it
    metrics = GatewayMetrics()
    metrics.record(_sample(meter))
    shown = _buckets(metrics.render())
    for bound in CHUNK_S:
        within = sum(gap <= bound for gap in written)
        assert shown[repr(float(bound))] == within, bound
    assert shown["+Inf"] == len(gaps)
