"""Totals per (tenant, period, model, backend): folded from records at write time, summed at query.

Periods are UTC hours and UTC days; both are maintained so that a month is ~30 rows per model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, cast

from proxy.ledger import histogram
from proxy.ledger.base import UsageRecord, failed

__all__ = [
    "COUNTERS",
    "DAY_S",
    "HOUR_S",
    "Cell",
    "CellKey",
    "Granularity",
    "Tally",
    "period_start",
    "roll_up",
]

Granularity = Literal["hour", "day"]
HOUR_S = 3600
DAY_S = 86400
PERIOD_S: dict[Granularity, int] = {"hour": HOUR_S, "day": DAY_S}

COUNTERS = (
    "requests",
    "errors",
    "rate_limited",
    "degraded",
    "shaped",
    "client_disconnects",
    "input_tokens",
    "output_tokens",
    "cost_nusd",
    "cache_hits",
    "cache_semantic_hits",
    "cache_misses",
    "duration_ms_total",
    "saved_input_tokens",
    "saved_output_tokens",
    "saved_cost_nusd",
    "counted_requests",
    "estimated_requests",
)
"""The integer totals of a Tally, in storage order (column order, Redis field names)."""

_COUNTED = frozenset({"counted", "counted_output"})

CellKey = tuple[str | None, int, str | None, str | None]
"""(tenant, period start in epoch seconds, model, backend)."""


@dataclass(slots=True)
class Tally:
    requests: int = 0
    errors: int = 0
    rate_limited: int = 0
    degraded: int = 0
    shaped: int = 0
    client_disconnects: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost_nusd: int = 0
    cache_hits: int = 0
    cache_semantic_hits: int = 0
    cache_misses: int = 0
    duration_ms_total: int = 0
    saved_input_tokens: int = 0
    saved_output_tokens: int = 0
    saved_cost_nusd: int = 0
    counted_requests: int = 0
    estimated_requests: int = 0
    ttft_ms: histogram.Histogram = field(default_factory=dict)
    tokens_per_s: histogram.Histogram = field(default_factory=dict)

    def add(self, record: UsageRecord) -> None:
        self.requests += 1
        self.errors += failed(record)
        self.rate_limited += record.status == 429
        self.degraded += bool(record.degraded)
        self.shaped += bool(record.shaped)
        self.client_disconnects += record.client_disconnected
        self.input_tokens += record.input_tokens
        self.output_tokens += record.output_tokens
        self.cost_nusd += record.cost_nusd
        self.cache_hits += record.cache == "hit"
        self.cache_semantic_hits += record.cache == "semantic-hit"
        self.cache_misses += record.cache == "miss"
        self.duration_ms_total += round(record.duration_ms)
        self.saved_input_tokens += record.saved_input_tokens
        self.saved_output_tokens += record.saved_output_tokens
        self.saved_cost_nusd += record.saved_cost_nusd
        self.counted_requests += record.usage_source in _COUNTED
        self.estimated_requests += record.usage_source == "estimated"
        if record.ttft_ms is not None:
            _bump(self.ttft_ms, histogram.TTFT_MS.index(record.ttft_ms))
        if record.tokens_per_s is not None:
            _bump(self.tokens_per_s, histogram.TOKENS_PER_S.index(record.tokens_per_s))

    def withdraw(self, record: UsageRecord) -> None:
        """Take a superseded checkpoint's counters back out. A checkpoint carries no TTFT or
        speed sample (stages/checkpoint.py), so the histograms are left as they are."""
        taken = Tally()
        taken.add(record)
        for name in COUNTERS:
            setattr(self, name, getattr(self, name) - getattr(taken, name))

    def merge(self, other: Tally) -> None:
        for name in COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        histogram.merge_into(self.ttft_ms, other.ttft_ms.items())
        histogram.merge_into(self.tokens_per_s, other.tokens_per_s.items())

    def counters(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in COUNTERS)

    @classmethod
    def from_counters(
        cls,
        values: Iterable[int],
        ttft_ms: histogram.Histogram,
        tokens_per_s: histogram.Histogram,
    ) -> Tally:
        tally = cls(ttft_ms=ttft_ms, tokens_per_s=tokens_per_s)
        for name, value in zip(COUNTERS, values, strict=True):
            setattr(tally, name, value)
        return tally


@dataclass(frozen=True, slots=True)
class Cell:
    """One stored aggregate row as read back: its key and its totals."""

    key: CellKey
    tally: Tally


def period_start(ts: float, granularity: Granularity) -> int:
    size = PERIOD_S[granularity]
    return int(ts // size) * size


_K = TypeVar("_K", bound=tuple[Any, ...])


def roll_up(hours: dict[_K, Tally]) -> dict[_K, Tally]:
    """Hour increments summed into day increments; a key's second item is its period start."""
    days: dict[_K, Tally] = {}
    for hour_key, tally in hours.items():
        day_key = cast(_K, (hour_key[0], period_start(hour_key[1], "day"), *hour_key[2:]))
        day = days.get(day_key)
        if day is None:
            day = days[day_key] = Tally()
        day.merge(tally)
    return days


def _bump(counts: histogram.Histogram, index: int) -> None:
    counts[index] = counts.get(index, 0) + 1
