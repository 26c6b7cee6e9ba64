"""What the dashboard shows, read from the ledger's hour and day totals: no raw-record scans.

The overview is three ledger queries (today, this month, the chosen window); a tenant page adds
the window by bucket, by model, key, user and tag, and error kinds from a bounded sample of its
newest records.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass

from proxy.ledger import Bucket, GroupBy, Ledger, UsageQuery, UsageRow
from proxy.ledger import query as planner
from proxy.ledger.aggregate import DAY_S, HOUR_S
from proxy.ledger.base import failed
from proxy.ledger.present import day_start, month_start
from proxy.ledger.query import empty_row, total_of
from proxy.policy.model import Budget, Policy

__all__ = [
    "ERROR_SAMPLE",
    "Overview",
    "Quota",
    "TenantPage",
    "TenantSummary",
    "Window",
    "load_overview",
    "load_tenant_page",
]

ERROR_SAMPLE = 2000
"""Error kinds are counted among this many of a tenant's newest records (totals stay exact)."""

BREAKDOWN_ROWS = 25
"""A tenant page lists this many keys, users, tags or models, the costliest."""

_WARN_RATIO = 0.8
_NUSD_PER_USD = 1_000_000_000


@dataclass(frozen=True, slots=True)
class Window:
    """[since, until) as asked at `now`; `start`/`end` the whole hours the ledger answers for."""

    since: float
    until: float
    bucket: Bucket
    now: float

    @property
    def start(self) -> float:
        return float(planner.window(UsageQuery(None, self.since, self.until))[0])

    @property
    def end(self) -> float:
        return float(planner.window(UsageQuery(None, self.since, self.until))[1])

    def query(
        self, tenant: str | None, *, bucket: Bucket | None = None, group_by: GroupBy | None = None
    ) -> UsageQuery:
        return UsageQuery(tenant, self.since, self.until, bucket, group_by, self.now)


@dataclass(frozen=True, slots=True)
class Quota:
    """One budget quota against what the ledger recorded in its period: tokens, or nano-USD for
    a USD quota (exact, as the ledger and the enforcement count it)."""

    name: str
    used: int
    limit: int

    @property
    def in_usd(self) -> bool:
        return self.name.startswith("usd")

    @property
    def ratio(self) -> float:
        # A USD limit under half a nano-USD is enforced as 0: nothing priced fits.
        return self.used / self.limit if self.limit else 1.0

    @property
    def level(self) -> str:
        """`ok`, `warn` past 80%, `over` at or past the limit: the bar's colour."""
        if self.ratio >= 1.0:
            return "over"
        return "warn" if self.ratio >= _WARN_RATIO else "ok"


@dataclass(frozen=True, slots=True)
class TenantSummary:
    tenant: str | None
    today: UsageRow
    month: UsageRow
    window: UsageRow
    quotas: tuple[Quota, ...]


@dataclass(frozen=True, slots=True)
class Overview:
    window: Window
    tenants: tuple[TenantSummary, ...]
    total: UsageRow


@dataclass(frozen=True, slots=True)
class TenantPage:
    summary: TenantSummary
    window: Window
    series: tuple[UsageRow, ...]
    by_model: tuple[UsageRow, ...]
    by_key: tuple[UsageRow, ...]
    by_user: tuple[UsageRow, ...]
    by_tag: tuple[UsageRow, ...]
    error_kinds: tuple[tuple[str, int], ...]
    errors_sampled: int
    breakdown: tuple[int, int] | None = None
    """The whole UTC days the key, user and tag tables cover, when wider than the window."""


def quotas(budget: Budget | None, today: UsageRow, month: UsageRow) -> tuple[Quota, ...]:
    """The tenant's token and USD quotas, each with what it used in its UTC day or month."""
    if budget is None:
        return ()
    found: list[Quota] = []
    for name, limit, row, usd in (
        ("usd_per_day", budget.usd_per_day, today, True),
        ("usd_per_month", budget.usd_per_month, month, True),
        ("tokens_per_day", budget.tokens_per_day, today, False),
        ("tokens_per_month", budget.tokens_per_month, month, False),
    ):
        if limit is None:
            continue
        if usd:  # the limit in nano-USD as the budget stage enforces it
            found.append(Quota(name, row.cost_nusd, round(limit * _NUSD_PER_USD)))
        else:
            found.append(Quota(name, row.input_tokens + row.output_tokens, int(limit)))
    return tuple(found)


async def load_overview(
    ledger: Ledger, policy: Policy, tenant: str | None, window: Window, now: float
) -> Overview:
    """Every tenant (`tenant` None) or one: today, this month and the window, one query each."""
    today, month, chosen = await asyncio.gather(
        ledger.query(UsageQuery(tenant, day_start(now), now)),
        ledger.query(UsageQuery(tenant, month_start(now), now)),
        ledger.query(window.query(tenant)),
    )
    by_tenant = [{row.tenant: row for row in rows} for rows in (today, month, chosen)]
    if tenant is None:
        names = set(policy.tenants).union(*(found.keys() for found in by_tenant))
        ordered = sorted(names, key=lambda name: (name is None, name or ""))
    else:
        ordered = [tenant]
    summaries = tuple(_summary(policy, name, *by_tenant) for name in ordered)
    return Overview(window, summaries, total_of(chosen))


async def load_tenant_page(
    ledger: Ledger, policy: Policy, tenant: str, window: Window, now: float
) -> TenantPage:
    groups: tuple[GroupBy, ...] = ("model", "key", "user", "tag")
    overview, series, latest, (by_model, by_key, by_user, by_tag) = await asyncio.gather(
        load_overview(ledger, policy, tenant, window, now),
        ledger.query(window.query(tenant, bucket=window.bucket)),
        ledger.latest(tenant, ERROR_SAMPLE),
        asyncio.gather(*(ledger.query(window.query(tenant, group_by=g)) for g in groups)),
    )
    kinds = Counter(
        record.error or f"http_{record.status}"
        for record in latest
        if failed(record) and window.start <= record.ts < window.end
    )
    return TenantPage(
        summary=overview.tenants[0],
        window=window,
        series=tuple(fill_buckets(series, window, tenant)),
        by_model=_costliest(by_model),
        by_key=_costliest(by_key),
        by_user=_costliest(by_user),
        by_tag=_costliest(by_tag),
        error_kinds=tuple(kinds.most_common(8)),
        errors_sampled=len(latest),
        breakdown=_breakdown_window(window, tenant),
    )


def _breakdown_window(window: Window, tenant: str) -> tuple[int, int] | None:
    """What the tables by key, user and tag cover, if not the window: an edge older than the
    hour totals by those (8 days) widens to its UTC day (proxy.ledger.query.window)."""
    covered = planner.window(window.query(tenant, group_by="key"))
    return None if covered == (window.start, window.end) else covered


def _costliest(rows: list[UsageRow]) -> tuple[UsageRow, ...]:
    """Costliest first, at most BREAKDOWN_ROWS (the JSON link has them all)."""
    ordered = sorted(rows, key=lambda row: (-row.cost_nusd, -row.requests, row.key or ""))
    return tuple(ordered[:BREAKDOWN_ROWS])


def fill_buckets(rows: list[UsageRow], window: Window, tenant: str | None) -> list[UsageRow]:
    """One row per bucket of the window, zeros where nothing happened (charts need no gaps)."""
    size = HOUR_S if window.bucket == "hour" else DAY_S
    first = int(window.start) - int(window.start) % size
    found = {int(row.bucket_start or 0): row for row in rows}
    filled = []
    for start in range(first, int(window.end), size):
        filled.append(found.get(start) or empty_row(tenant, start, window.bucket))
    return filled


def _summary(
    policy: Policy,
    name: str | None,
    today: dict[str | None, UsageRow],
    month: dict[str | None, UsageRow],
    chosen: dict[str | None, UsageRow],
) -> TenantSummary:
    day_row = today.get(name) or empty_row(name)
    month_row = month.get(name) or empty_row(name)
    spec = policy.tenants.get(name) if name is not None else None
    budget = spec.budget if spec is not None else None
    return TenantSummary(
        tenant=name,
        today=day_row,
        month=month_row,
        window=chosen.get(name) or empty_row(name),
        quotas=quotas(budget, day_row, month_row),
    )
