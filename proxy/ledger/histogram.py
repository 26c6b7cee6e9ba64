"""Log-spaced histograms small enough to keep per aggregate row, and percentiles read from them.

Four bins per octave: a reported percentile is the bin's geometric midpoint, so it lies within
2**(1/8) - 1 = ±9.1% of the exact nearest-rank percentile (values outside the range clamp).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "TOKENS_PER_S",
    "TTFT_MS",
    "BlobSum",
    "Histogram",
    "LogScale",
    "decode",
    "encode",
    "merge_into",
    "quantile",
]

Histogram = dict[int, int]
"""Sparse counts: bin index -> number of samples; empty bins are absent."""

_PAIR = struct.Struct("<HQ")


@dataclass(frozen=True, slots=True)
class LogScale:
    """Bin 0 holds values below `low`, the last bin everything above the top edge."""

    low: float
    per_octave: int
    bins: int

    def index(self, value: float) -> int:
        if not value >= self.low:  # also NaN
            return 0
        position = int(math.log2(value / self.low) * self.per_octave) + 1
        return min(position, self.bins - 1)

    def value(self, index: int) -> float:
        """The value reported for samples in bin `index`."""
        if index <= 0:
            return self.low
        if index >= self.bins - 1:
            return self.low * math.pow(2.0, (self.bins - 2) / self.per_octave)
        return self.low * math.pow(2.0, (index - 0.5) / self.per_octave)


TTFT_MS = LogScale(low=0.1, per_octave=4, bins=82)
"""Time to first token: 0.1 ms to 105 s."""

TOKENS_PER_S = LogScale(low=1.0, per_octave=4, bins=66)
"""Output speed per request: 1 to 65,536 tokens/s."""


def quantile(histogram: Mapping[int, int], q: float, scale: LogScale) -> float | None:
    """The nearest-rank `q` quantile (0 < q <= 1), or None for an empty histogram."""
    total = sum(histogram.values())
    if total == 0:
        return None
    rank = max(1, math.ceil(q * total))
    seen = 0
    for index in sorted(histogram):
        seen += histogram[index]
        if seen >= rank:
            return round(scale.value(index), 3)
    raise AssertionError("unreachable: rank <= total")


def merge_into(target: Histogram, counts: Iterable[tuple[int, int]]) -> None:
    for index, count in counts:
        target[index] = target.get(index, 0) + count


def encode(histogram: Mapping[int, int]) -> bytes:
    """Sorted (uint16 bin, uint64 count) pairs, little-endian: 10 bytes per non-empty bin."""
    return b"".join(_PAIR.pack(i, histogram[i]) for i in sorted(histogram) if histogram[i])


def decode(blob: bytes | None) -> Histogram:
    if not blob:
        return {}
    return dict(_PAIR.iter_unpack(blob))


class BlobSum:
    """SQLite aggregate `tw_hist_sum(blob)`: the sum of encoded histograms, encoded."""

    def __init__(self) -> None:
        self._counts: Histogram = {}

    def step(self, blob: bytes | None) -> None:
        if blob:
            merge_into(self._counts, _PAIR.iter_unpack(blob))

    def finalize(self) -> bytes:
        return encode(self._counts)
