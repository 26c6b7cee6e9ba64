"""The ledger contract: a usage record per request, the query over its totals, the protocol."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal, Protocol

__all__ = [
    "RECORD_FIELDS",
    "Bucket",
    "GroupBy",
    "Ledger",
    "LedgerError",
    "LedgerStats",
    "UsageQuery",
    "UsageRecord",
    "UsageRow",
    "record_values",
]

Bucket = Literal["hour", "day"]
GroupBy = Literal["model", "backend"]


class LedgerError(Exception):
    """The ledger cannot be opened, read, or made durable (never raised by `append`)."""


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """What one request did and cost; `tenant` is None for requests rejected before auth."""

    ts: float
    request_id: str
    tenant: str | None
    model: str | None
    backend: str | None
    operation: str
    stream: bool
    status: int
    error: str | None
    input_tokens: int
    output_tokens: int
    cost_nusd: int
    cache: str
    ttft_ms: float | None
    tokens_per_s: float | None
    duration_ms: float
    shaped: tuple[str, ...]
    degraded: tuple[str, ...]
    client_disconnected: bool
    # What a cache hit saved: the backend tokens and money the original answer cost.
    saved_input_tokens: int = 0
    saved_output_tokens: int = 0
    saved_cost_nusd: int = 0


RECORD_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(UsageRecord))


def record_values(record: UsageRecord) -> tuple[Any, ...]:
    """A record's fields in declaration order: how both ledgers store it, `UsageRecord(*values)`
    reads it back."""
    return tuple(getattr(record, name) for name in RECORD_FIELDS)


@dataclass(frozen=True, slots=True)
class UsageQuery:
    """Usage in [since, until) (epoch seconds), widened to whole UTC hours: the ledger's grain.

    `tenant` None means every tenant. `bucket` splits the window into UTC hours or days;
    `group_by` splits it by model or backend.
    """

    tenant: str | None
    since: float
    until: float
    bucket: Bucket | None = None
    group_by: GroupBy | None = None

    def __post_init__(self) -> None:
        if not self.since < self.until:
            raise ValueError(f"since ({self.since}) must be before until ({self.until})")
        if self.bucket not in (None, "hour", "day"):
            raise ValueError(f"bucket must be hour, day or None, got {self.bucket!r}")
        if self.group_by not in (None, "model", "backend"):
            raise ValueError(f"group_by must be model, backend or None, got {self.group_by!r}")


@dataclass(frozen=True, slots=True)
class UsageRow:
    """Totals for one tenant, one bucket (or the whole window) and one model or backend.

    `errors` counts statuses >= 400, `rate_limited` 429s, `degraded`/`shaped` requests that a
    degradation rule or a budget clamp changed. Percentiles come from log-spaced histograms and
    are within ±9.1% of the exact nearest-rank value (see `proxy.ledger.histogram`).
    """

    tenant: str | None
    bucket_start: float | None
    key: str | None
    requests: int
    errors: int
    rate_limited: int
    degraded: int
    shaped: int
    client_disconnects: int
    input_tokens: int
    output_tokens: int
    cost_nusd: int
    cache_hits: int
    cache_semantic_hits: int
    cache_misses: int
    saved_input_tokens: int
    saved_output_tokens: int
    saved_cost_nusd: int
    duration_ms_total: int
    ttft_ms_p50: float | None
    ttft_ms_p95: float | None
    tokens_per_s_p50: float | None

    @property
    def cache_hit_rate(self) -> float | None:
        """Exact and semantic hits over cache lookups (bypassed requests are not lookups)."""
        hits = self.cache_hits + self.cache_semantic_hits
        lookups = hits + self.cache_misses
        return hits / lookups if lookups else None


@dataclass(frozen=True, slots=True)
class LedgerStats:
    """Counters for /metrics and /readyz: nothing is dropped without being counted here."""

    appended: int
    written: int
    dropped: int
    buffered: int
    write_failures: int
    last_error: str | None


class Ledger(Protocol):
    def append(self, record: UsageRecord) -> None:
        """Buffer `record` in microseconds; never blocks, never raises. Call from the event loop."""

    async def start(self) -> None:
        """Open the store, create or check its schema, start the background writer."""

    async def flush(self) -> None:
        """Return once everything appended so far is durable; LedgerError if the store is down."""

    async def aclose(self) -> None:
        """Flush, then close; records that still cannot be written are logged as lost."""

    async def query(self, q: UsageQuery) -> list[UsageRow]:
        """Aggregated usage, served from per-hour and per-day totals, never from raw records."""

    async def latest(self, tenant: str | None, limit: int) -> list[UsageRecord]:
        """The newest raw records, newest first; `tenant` None means every tenant."""

    def stats(self) -> LedgerStats:
        """Counters since this ledger was created."""
