"""Log-spaced histograms: percentiles within ±9.1%, compact and lossless storage."""

from __future__ import annotations

import math
import random

import pytest

from proxy.ledger import histogram
from proxy.ledger.histogram import TOKENS_PER_S, TTFT_MS, LogScale


def exact(values: list[float], q: float) -> float:
    return sorted(values)[max(1, math.ceil(q * len(values))) - 1]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("q", [0.01, 0.5, 0.9, 0.95, 0.99, 1.0])
def test_percentile_within_nine_percent_of_exact(seed: int, q: float) -> None:
    rng = random.Random(seed)  # noqa: S311 (reproducible samples)
    values = [rng.lognormvariate(math.log(300), 1.0) for _ in range(rng.randint(1, 3000))]
    counts: histogram.Histogram = {}
    histogram.merge_into(counts, ((TTFT_MS.index(v), 1) for v in values))
    estimate = histogram.quantile(counts, q, TTFT_MS)
    assert estimate == pytest.approx(exact(values, q), rel=2 ** (1 / 8) - 1 + 1e-3)


def test_out_of_range_values_clamp_to_the_end_bins() -> None:
    assert TTFT_MS.index(0.0) == 0
    assert TTFT_MS.index(float("nan")) == 0
    assert TTFT_MS.value(TTFT_MS.index(0.05)) == 0.1
    top = TTFT_MS.index(10_000_000.0)
    assert top == TTFT_MS.bins - 1
    assert TTFT_MS.value(top) == pytest.approx(0.1 * 2**20)
    assert TOKENS_PER_S.value(TOKENS_PER_S.bins - 1) == pytest.approx(65536)


def test_bins_are_monotonic_and_quarter_octaves() -> None:
    scale = LogScale(low=1.0, per_octave=4, bins=20)
    assert [scale.index(2 ** (i / 4) * 1.0001) for i in range(8)] == list(range(1, 9))
    assert scale.value(5) / scale.value(4) == pytest.approx(2**0.25)


def test_empty_histogram_has_no_percentile() -> None:
    assert histogram.quantile({}, 0.5, TTFT_MS) is None


def test_encoding_round_trips_and_skips_empty_bins() -> None:
    counts = {0: 1, 7: 3, 81: 4_000_000_000, 12: 0}
    blob = histogram.encode(counts)
    assert len(blob) == 3 * 10
    assert histogram.decode(blob) == {0: 1, 7: 3, 81: 4_000_000_000}
    assert histogram.decode(b"") == {}
    assert histogram.decode(None) == {}
