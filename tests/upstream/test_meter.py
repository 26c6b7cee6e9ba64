"""The stream meter, driven by a fake clock: TTFT, gaps, tokens/s and gateway time."""

from __future__ import annotations

import math
import random

import pytest

from proxy.clock import FakeClock
from proxy.telemetry.semconv import CHUNK_S
from proxy.upstream import meter
from proxy.upstream.meter import GapHistogram, StreamMeter


def test_stream_timings() -> None:
    clock = FakeClock()
    meter = StreamMeter(clock.monotonic())
    clock.advance(0.002)  # the gateway's own stages
    meter.sending_upstream(clock.monotonic())
    clock.advance(0.200)  # prefill
    meter.read(clock.monotonic())
    meter.wrote(clock.monotonic(), 0, False)  # the role chunk: no text yet
    for _ in range(100):
        clock.advance(0.010)
        meter.read(clock.monotonic())
        clock.advance(0.0001)
        meter.wrote(clock.monotonic(), 1, True)
    assert meter.upstream_ttft_s == pytest.approx(0.200)
    assert meter.ttft_s == pytest.approx(0.2121, abs=1e-9)
    assert meter.token_events == 100
    assert meter.gaps.count == 99
    assert meter.gaps.quantile_s(0.5) == pytest.approx(0.0101, rel=0.07)
    assert meter.tokens_per_s(100, 1) == pytest.approx(1 / 0.0101, rel=1e-9)
    assert meter.gateway_s == pytest.approx(0.002 + 100 * 0.0001, rel=1e-6)


def test_several_choices_leave_out_each_ones_first_token() -> None:
    """n = 2: both choices' first tokens come at the first write, then two tokens each 10 ms
    apart: 4 tokens in 20 ms after the first, 200 tokens/s (it said 250). One token a choice
    is no rate at all (it said 1 / 1 ms: 1,000 tokens/s)."""
    clock = FakeClock()
    meter = StreamMeter(clock.monotonic())
    for _ in range(3):
        clock.advance(0.010)
        meter.wrote(clock.monotonic(), 2, True)
    assert meter.tokens_per_s(6, 2) == pytest.approx(200.0)
    assert meter.tokens_per_s(6, 1) == pytest.approx(250.0)  # n = 1: one first token
    single = StreamMeter(0.0)
    single.wrote(0.100, 1, True)
    single.wrote(0.101, 1, True)
    assert single.tokens_per_s(2, 2) is None


def test_no_tokens_no_rates() -> None:
    meter = StreamMeter(0.0)
    assert meter.ttft_s is None
    assert meter.tokens_per_s(0, 1) is None
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


def _bucket_of(gap_s: float) -> int:
    hist = GapHistogram()
    hist.add(gap_s)
    return hist.counts.index(1)


def test_a_gap_lands_in_the_bucket_its_logarithm_names() -> None:
    """The table of bucket starts holds every start of the log-spaced definition, and one more
    just above each time-per-chunk boundary: a gap lands in the bucket the definition names,
    moved on by the boundaries below it; at every start, a float either side of it, and for
    gaps across the whole range."""
    starts = meter._BUCKET_STARTS
    assert len(starts) == len(GapHistogram().counts) - 1
    by_log = {meter._lowest_in(bucket) for bucket in range(1, meter._BUCKET_COUNT)}
    splits = [math.nextafter(bound, math.inf) for bound in CHUNK_S]
    assert set(starts) == by_log | set(splits)
    added = [split for split in splits if split not in by_log]
    edges = [math.nextafter(start, side) for start in starts for side in (0.0, math.inf)]
    rng = random.Random(7)  # noqa: S311 (test data, not a secret)
    spread = [10 ** rng.uniform(-8, 4) for _ in range(20_000)]
    for gap_s in [*starts, *edges, *spread, 0.0, -1.0, 50e-6, 1e9]:
        moved = sum(split <= gap_s for split in added)
        assert _bucket_of(gap_s) == meter._bucket_by_log(gap_s) + moved, gap_s
    assert _bucket_of(50e-6) == 0
    assert _bucket_of(1e9) == len(starts)


def test_writes_without_text_are_counted_but_not_timed() -> None:
    """Tokens 10 ms apart, a textless event 500 ms after one of them (a filter's verdict, a
    role, empty `choices`) and tokens again at once, then a finish event 500 ms later: the
    gaps are the ones between tokens (510 ms, not 500 and 10); the events stay counted
    (`token_events`: the bill's estimate reads them)."""
    clock = FakeClock()
    meter = StreamMeter(clock.monotonic())
    for _ in range(3):
        clock.advance(0.010)
        meter.wrote(clock.monotonic(), 1, True)
    clock.advance(0.500)
    meter.wrote(clock.monotonic(), 1, False)
    clock.advance(0.010)
    meter.wrote(clock.monotonic(), 1, True)
    clock.advance(0.500)
    meter.wrote(clock.monotonic(), 1, False)  # the finish event
    assert meter.gaps.count == 3
    assert meter.gaps.total_s == pytest.approx(0.530)
    assert meter.gaps.max_s == pytest.approx(0.510)
    assert meter.tokens_per_s(4, 1) == pytest.approx(3 / 0.530)
    assert meter.token_events == 6
    assert meter.ttft_s == pytest.approx(0.010)
