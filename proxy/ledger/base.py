"""The ledger contract: a usage record per request, the query over its totals, the protocol."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, Protocol

__all__ = [
    "ATTRIBUTES",
    "RECORD_FIELDS",
    "Bucket",
    "GroupBy",
    "Ledger",
    "LedgerError",
    "LedgerStats",
    "UsageQuery",
    "UsageRecord",
    "UsageRow",
    "bounded",
    "failed",
    "record_values",
]

MAX_RECORD_INT = 10**15
"""The largest integer a record stores (tokens, nano-USD): far above any real request (10**8
tokens at $100 per million tokens is 10**13 nano-USD); 9,000 of them still sum within int64,
past which the Redis ledger carries (lua/append.lua) and SQLite rounds (docs/usage.md)."""
MAX_RECORD_CHARS = 256
_MAX_DURATION_MS = float(MAX_RECORD_INT)
_INTS = (
    "status", "input_tokens", "output_tokens", "cost_nusd", "saved_input_tokens",
    "saved_output_tokens", "saved_cost_nusd", "counted_input_tokens",
)  # fmt: skip
_FLOATS = ("ttft_ms", "tokens_per_s", "duration_ms")
_TEXTS = (
    "request_id", "tenant", "model", "backend", "operation", "error", "cache", "usage_source",
    "key_id", "user",
)  # fmt: skip
MAX_RECORD_TAGS = 8
MAX_TAG_CHARS = 64

Bucket = Literal["hour", "day"]
GroupBy = Literal["model", "backend", "key", "user", "tag"]
ATTRIBUTES: tuple[str, ...] = ("key", "user", "tag")
"""The groupings below the tenant: the API key's id, the OpenAI `user` field, request tags."""
_GROUPS = ("model", "backend", *ATTRIBUTES)


class LedgerError(Exception):
    """The ledger cannot be opened, read, or made durable (never raised by `append`)."""


@dataclass(slots=True)
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
    # backend | counted | estimated | counted_output | cache; None: nothing billed (no backend
    # answered). See proxy.context.UsageSource.
    usage_source: str | None = None
    # The gateway's own count of the prompt, billed or not (a refused request bills nothing).
    counted_input_tokens: int = 0
    # Attribution: the key's non-secret id (see proxy.keys.record.key_id_of), the request's
    # `user` field and its tags (x-tokenweir-tags and `metadata` values), as stages/attribute.py
    # checked them.
    key_id: str | None = None
    user: str | None = None
    tags: tuple[str, ...] = ()
    # True: usage so far of a request still running (stages/checkpoint.py), what a crash leaves;
    # a later record of the request supersedes it. Stored.
    checkpoint: bool = False
    # The request's previous checkpoint, which this record replaces in the totals and the raw
    # records (so nothing is counted twice). Not stored: a link within one gateway process.
    supersedes: UsageRecord | None = field(default=None, compare=False, repr=False)

    @property
    def link(self) -> str:
        """What names a request's checkpoint among the raw records (a client may reuse ids)."""
        return f"{self.request_id}@{self.ts!r}"


RECORD_FIELDS: tuple[str, ...] = tuple(
    f.name for f in fields(UsageRecord) if f.name != "supersedes"
)


_STORED = operator.attrgetter(*RECORD_FIELDS)


def failed(record: UsageRecord) -> bool:
    """The client got an error: an error status, or an error event ending a stream under the
    200 already sent (a backend that broke off, a shutdown's cut): `error` names it."""
    return record.status >= 400 or record.error is not None


def record_values(record: UsageRecord) -> tuple[Any, ...]:
    """A record's stored fields in declaration order: how both ledgers store it,
    `UsageRecord(*values)` reads it back."""
    values: tuple[Any, ...] = _STORED(record)
    return values


def bounded(record: UsageRecord) -> UsageRecord:
    """`record`, or a copy with every number and string in the range both ledgers store: ints in
    [0, MAX_RECORD_INT], finite floats (`duration_ms`, summed as an integer, in the same range
    as the ints), strings of at most MAX_RECORD_CHARS. The request path
    checks its figures already; this keeps one bad record from failing a batch (and the rest)."""
    changes: dict[str, Any] = {}
    for name in _INTS:
        value = getattr(record, name)
        if type(value) is not int or not 0 <= value <= MAX_RECORD_INT:
            changes[name] = _clamp(value)
    for name in _FLOATS:
        value = getattr(record, name)
        if value is not None and (type(value) is not float or not math.isfinite(value)):
            changes[name] = _finite(value, name)
    duration_ms = changes.get("duration_ms", record.duration_ms)
    if not 0.0 <= duration_ms <= _MAX_DURATION_MS:  # it is summed as an integer
        changes["duration_ms"] = min(max(duration_ms, 0.0), _MAX_DURATION_MS)
    for name in _TEXTS:
        value = getattr(record, name)
        if value is not None and (type(value) is not str or len(value) > MAX_RECORD_CHARS):
            changes[name] = str(value)[:MAX_RECORD_CHARS]
    tags = record.tags
    if tags and (len(tags) > MAX_RECORD_TAGS or any(len(t) > MAX_TAG_CHARS for t in tags)):
        changes["tags"] = tuple(str(t)[:MAX_TAG_CHARS] for t in tags[:MAX_RECORD_TAGS])
    return replace(record, **changes) if changes else record


def _clamp(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        return 0
    return int(min(max(value, 0), MAX_RECORD_INT))


def _finite(value: object, name: str) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return 0.0 if name == "duration_ms" else None


@dataclass(frozen=True, slots=True)
class UsageQuery:
    """Usage in [since, until) (epoch seconds), widened to whole UTC hours: the ledger's grain.

    `tenant` None means every tenant. `bucket` splits the window into UTC hours or days;
    `group_by` splits it by model, backend, key, user or tag (a request with two tags counts
    under each, so rows grouped by tag may sum to more than the tenant's total). `now` is when
    the question is asked: the hour totals by key, user and tag are kept 8 days before it, so
    an older window by those is answered in whole UTC days (None: as if asked at `until`).
    """

    tenant: str | None
    since: float
    until: float
    bucket: Bucket | None = None
    group_by: GroupBy | None = None
    now: float | None = None

    def __post_init__(self) -> None:
        if not self.since < self.until:
            raise ValueError(f"since ({self.since}) must be before until ({self.until})")
        if self.bucket not in (None, "hour", "day"):
            raise ValueError(f"bucket must be hour, day or None, got {self.bucket!r}")
        if self.group_by is not None and self.group_by not in _GROUPS:
            raise ValueError(f"group_by must be one of {_GROUPS} or None, got {self.group_by!r}")


@dataclass(frozen=True, slots=True)
class UsageRow:
    """Totals for one tenant, one bucket (or the whole window) and one group (`key`: the model,
    backend, key id, user or tag; None for requests without one, OTHER for the values past the
    ledger's bound, see proxy.ledger.attribution).

    `errors` counts statuses >= 400, `rate_limited` 429s, `degraded`/`shaped` requests that a
    degradation rule or a budget clamp changed, `counted_requests`/`estimated_requests` those
    billed on the gateway's own count (exact tokenizer) or on its estimate (none configured).
    Percentiles come from log-spaced histograms and
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
    counted_requests: int
    estimated_requests: int
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
        """The raw records last written, the last first (a request's record is written when it
        ends, so this is not the order of their `ts`); `tenant` None means every tenant."""

    def stats(self) -> LedgerStats:
        """Counters since this ledger was created."""

    async def evicting(self) -> str | None:
        """How the store may delete records and totals by itself (Redis's `maxmemory-policy`
        when it is not `noeviction`), else None; LedgerError if the store cannot be asked."""
