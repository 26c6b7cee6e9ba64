"""Answer a UsageQuery from stored cells: which periods to read, then how to sum them into rows.

Whole UTC days inside the window are read from day cells, the hours at either edge from hour
cells, so a month costs ~30 rows per (tenant, model, backend) whatever the request volume.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from proxy.ledger import histogram
from proxy.ledger.aggregate import DAY_S, HOUR_S, Cell, Granularity, Tally
from proxy.ledger.attribution import HOUR_RETENTION_S, is_attribution
from proxy.ledger.base import ATTRIBUTES, Bucket, UsageQuery, UsageRow

__all__ = ["Span", "empty_row", "plan", "rows", "total_of", "window"]


@dataclass(frozen=True, slots=True)
class Span:
    """Read cells of `granularity` whose period starts in [start, end)."""

    granularity: Granularity
    start: int
    end: int


def window(q: UsageQuery) -> tuple[int, int]:
    """The query's window widened to whole hours: what the answer actually covers. By key,
    user or tag, an edge older than the hour cells kept by those is widened to its UTC day."""
    start = math.floor(q.since / HOUR_S) * HOUR_S
    end = max(math.ceil(q.until / HOUR_S) * HOUR_S, start + HOUR_S)
    if is_attribution(q) and q.bucket != "hour":
        kept_from = (end if q.now is None else q.now) - HOUR_RETENTION_S
        if start < kept_from:
            start -= start % DAY_S
        if end % DAY_S and end - end % DAY_S < kept_from:
            end += DAY_S - end % DAY_S
    return start, end


def plan(q: UsageQuery) -> list[Span]:
    start, end = window(q)
    if q.bucket == "hour":
        return [Span("hour", start, end)]
    first_day = math.ceil(start / DAY_S) * DAY_S
    last_day = math.floor(end / DAY_S) * DAY_S
    if first_day >= last_day:
        return [Span("hour", start, end)]
    spans = [Span("hour", start, first_day), Span("day", first_day, last_day)]
    spans.append(Span("hour", last_day, end))
    return [span for span in spans if span.start < span.end]


_RowKey = tuple[str | None, int | None, str | None]


def rows(q: UsageQuery, found: Iterable[Cell]) -> list[UsageRow]:
    """Sum cells into one row per (tenant, bucket, key), sorted; unauthenticated last."""
    sums: dict[_RowKey, Tally] = {}
    for cell in found:
        tenant, start, model, backend = cell.key
        row_key = (tenant, _bucket(q, start), _group(q, model, backend))
        total = sums.get(row_key)
        if total is None:
            total = sums[row_key] = Tally()
        total.merge(cell.tally)
    ordered = sorted(sums.items(), key=lambda item: _order(item[0]))
    return [_row(key, tally) for key, tally in ordered]


def _bucket(q: UsageQuery, start: int) -> int | None:
    if q.bucket == "hour":
        return start
    if q.bucket == "day":
        return start - start % DAY_S
    return None


def _group(q: UsageQuery, model: str | None, backend: str | None) -> str | None:
    # An attribution cell carries its value where an ordinary cell has its model.
    if q.group_by == "model" or q.group_by in ATTRIBUTES:
        return model or None
    if q.group_by == "backend":
        return backend
    return None


def _order(key: _RowKey) -> tuple[bool, str, int, bool, str]:
    tenant, bucket, group = key
    return (tenant is None, tenant or "", bucket or 0, group is None, group or "")


def _row(key: _RowKey, tally: Tally) -> UsageRow:
    tenant, bucket, group = key
    return UsageRow(
        tenant=tenant,
        bucket_start=None if bucket is None else float(bucket),
        key=group,
        requests=tally.requests,
        errors=tally.errors,
        rate_limited=tally.rate_limited,
        degraded=tally.degraded,
        shaped=tally.shaped,
        client_disconnects=tally.client_disconnects,
        input_tokens=tally.input_tokens,
        output_tokens=tally.output_tokens,
        cost_nusd=tally.cost_nusd,
        cache_hits=tally.cache_hits,
        cache_semantic_hits=tally.cache_semantic_hits,
        cache_misses=tally.cache_misses,
        saved_input_tokens=tally.saved_input_tokens,
        saved_output_tokens=tally.saved_output_tokens,
        saved_cost_nusd=tally.saved_cost_nusd,
        duration_ms_total=tally.duration_ms_total,
        counted_requests=tally.counted_requests,
        estimated_requests=tally.estimated_requests,
        ttft_ms_p50=histogram.quantile(tally.ttft_ms, 0.50, histogram.TTFT_MS),
        ttft_ms_p95=histogram.quantile(tally.ttft_ms, 0.95, histogram.TTFT_MS),
        tokens_per_s_p50=histogram.quantile(tally.tokens_per_s, 0.50, histogram.TOKENS_PER_S),
    )


def empty_row(tenant: str | None, start: int = 0, bucket: Bucket | None = None) -> UsageRow:
    """A row of zeros: a tenant with no usage in a window (or in the bucket at `start`)."""
    q = UsageQuery(tenant, start, start + 1.0, bucket)
    return rows(q, [Cell((tenant, start, None, None), Tally())])[0]


_SUMMED = (
    "requests", "errors", "rate_limited", "degraded", "shaped", "client_disconnects",
    "input_tokens", "output_tokens", "cost_nusd", "cache_hits", "cache_semantic_hits",
    "cache_misses", "saved_cost_nusd", "duration_ms_total", "counted_requests",
    "estimated_requests",
)  # fmt: skip


def total_of(rows: list[UsageRow]) -> UsageRow:
    """The counters summed over tenants. Percentiles cannot be summed from rows: left empty."""
    sums = {name: sum(getattr(row, name) for row in rows) for name in _SUMMED}
    none = dict.fromkeys(("ttft_ms_p50", "ttft_ms_p95", "tokens_per_s_p50"))
    return replace(empty_row(None), **sums, **none)  # type: ignore[arg-type]
