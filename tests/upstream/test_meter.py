"""The stream meter, driven by a fake clock: TTFT, gaps, tokens/s and gateway time."""

from __future__ import annotations

import pytest

from proxy.clock import FakeClock
from proxy.upstream.meter import GapHistogram, StreamMeter


def test_stream_timings() -> None:
    clock = FakeClock()
    meter = StreamMeter(clock.monotonic())
    clock.advance(0.002)  # the gateway's own stages
    meter.sending_upstream(clock.monotonic())
    clock.advance(0.200)  # prefill
    meter.read(clock.monotonic())
    meter.wrote(clock.monotonic(), 0)  # the role chunk: no text yet
    for _ in range(100):
        clock.advance(0.010)
        meter.read(clock.monotonic())
        clock.advance(0.0001)
        meter.wrote(clock.monotonic(), 1)
    assert meter.upstream_ttft_s == pytest.approx(0.200)
    assert meter.ttft_s == pytest.approx(0.2121, abs=1e-9)
    assert meter.token_events == 100
    assert meter.gaps.count == 99
    assert meter.gaps.quantile_s(0.5) == pytest.approx(0.0101, rel=0.07)
    assert meter.tokens_per_s(100) == pytest.approx(1 / 0.0101, rel=1e-9)
    assert meter.gateway_s == pytest.approx(0.002 + 100 * 0.0001, rel=1e-6)


def test_no_tokens_no_rates() -> None:
    meter = StreamMeter(0.0)
    assert meter.ttft_s is None
    assert meter.tokens_per_s(0) is None
    assert meter.gaps.quantile_s(0.5) is None


def test_histogram_quantiles_within_bucket_width() -> None:
    hist = GapHistogram()
    for ms in range(1, 101):
        hist.add(ms / 1000)
    assert hist.quantile_s(0.5) == pytest.approx(0.050, rel=0.12)
    assert hist.quantile_s(0.99) == pytest.approx(0.099, rel=0.12)
    assert hist.max_s == 0.1
    hist.add(1e-7)
    hist.add(1e6)
    assert hist.count == 102
