"""Statistics for bench results: percentiles, distribution summaries and the speed verdict bands."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["VERDICT_BANDS", "Summary", "VerdictBand", "percentile", "summarize", "verdict"]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation between ranks, as numpy's default.

    `values` need not be sorted. None for no values, so a missing measure is never a zero.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} is outside 0-100")
    if not values:
        return None
    ordered = sorted(values)
    return _sorted_percentile(ordered, q)


def _sorted_percentile(ordered: Sequence[float], q: float) -> float:
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    fraction = rank - low
    return ordered[low] + (ordered[high] - ordered[low]) * fraction


@dataclass(frozen=True, slots=True)
class Summary:
    """One measure's distribution over a level; every field is None when nothing was measured."""

    count: int
    mean: float | None = None
    min: float | None = None
    p10: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None


def summarize(values: Sequence[float]) -> Summary:
    """Count, mean, extremes and the p10/p50/p90/p99 percentiles of `values`."""
    if not values:
        return Summary(count=0)
    ordered = sorted(values)
    return Summary(
        count=len(ordered),
        mean=math.fsum(ordered) / len(ordered),
        min=ordered[0],
        p10=_sorted_percentile(ordered, 10),
        p50=_sorted_percentile(ordered, 50),
        p90=_sorted_percentile(ordered, 90),
        p99=_sorted_percentile(ordered, 99),
        max=ordered[-1],
    )


@dataclass(frozen=True, slots=True)
class VerdictBand:
    """Per-stream speeds from `low` (inclusive) up to `high` (exclusive) tokens/s."""

    low: float
    high: float
    label: str

    def describe(self) -> str:
        if math.isinf(self.high):
            return f">={self.low:g} tok/s: {self.label}"
        if self.low <= 0:
            return f"<{self.high:g} tok/s: {self.label}"
        return f"{self.low:g}-{self.high:g} tok/s: {self.label}"


VERDICT_BANDS: tuple[VerdictBand, ...] = (
    VerdictBand(0.0, 50.0, "too slow for interactive use"),
    VerdictBand(50.0, 150.0, "readable streaming"),
    VerdictBand(150.0, 300.0, "comfortable, well ahead of reading speed"),
    VerdictBand(300.0, 500.0, "fast"),
    VerdictBand(500.0, 750.0, "very fast"),
    VerdictBand(750.0, math.inf, "750-class deployment"),
)


def verdict(median_tokens_per_s: float | None) -> str:
    """The band a level's median per-stream speed falls in, as a sentence for the report."""
    if median_tokens_per_s is None or math.isnan(median_tokens_per_s):
        return "n/a: no per-stream speed measured (needs streaming and 2+ output tokens)"
    for band in VERDICT_BANDS:
        if band.low <= median_tokens_per_s < band.high:
            return band.describe()
    return VERDICT_BANDS[0].describe()
