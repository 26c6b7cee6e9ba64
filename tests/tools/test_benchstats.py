"""Percentiles, summaries and verdict bands of the bench statistics."""

from __future__ import annotations

import itertools

import pytest

from proxy.tools.bench.stats import VERDICT_BANDS, percentile, summarize, verdict


def test_percentile_interpolates_between_ranks() -> None:
    values = [10.0, 1.0, 9.0, 2.0, 8.0, 3.0, 7.0, 4.0, 6.0, 5.0]  # 1..10, shuffled
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile(values, 100) == 10.0


def test_percentile_of_one_value_and_of_none() -> None:
    assert percentile([0.25], 99) == 0.25
    assert percentile([], 50) is None


def test_percentile_rejects_out_of_range() -> None:
    with pytest.raises(ValueError, match="outside"):
        percentile([1.0], 101)


def test_summarize_known_data() -> None:
    summary = summarize([float(n) for n in range(101)])  # 0..100: percentile q is q
    assert summary.count == 101
    assert summary.mean == pytest.approx(50.0)
    assert (summary.min, summary.max) == (0.0, 100.0)
    assert (summary.p10, summary.p50, summary.p90, summary.p99) == pytest.approx(
        (10.0, 50.0, 90.0, 99.0)
    )


def test_summarize_nothing_is_all_none() -> None:
    summary = summarize([])
    assert summary.count == 0
    assert summary.p50 is None
    assert summary.mean is None


@pytest.mark.parametrize(
    ("speed", "expected"),
    [
        (0.0, "<50 tok/s: too slow for interactive use"),
        (49.99, "<50 tok/s: too slow for interactive use"),
        (50.0, "50-150 tok/s: readable streaming"),
        (149.99, "50-150 tok/s: readable streaming"),
        (150.0, "150-300 tok/s: comfortable, well ahead of reading speed"),
        (300.0, "300-500 tok/s: fast"),
        (499.99, "300-500 tok/s: fast"),
        (500.0, "500-750 tok/s: very fast"),
        (749.99, "500-750 tok/s: very fast"),
        (750.0, ">=750 tok/s: 750-class deployment"),
        (5000.0, ">=750 tok/s: 750-class deployment"),
    ],
)
def test_verdict_band_edges(speed: float, expected: str) -> None:
    assert verdict(speed) == expected


def test_verdict_without_a_speed() -> None:
    assert verdict(None).startswith("n/a")


def test_bands_cover_every_speed_without_gaps() -> None:
    assert VERDICT_BANDS[0].low == 0.0
    for lower, upper in itertools.pairwise(VERDICT_BANDS):
        assert lower.high == upper.low
