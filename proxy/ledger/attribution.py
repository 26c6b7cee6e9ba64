"""Totals below the tenant, per API key, end user and tag: folded at write time, bounded.

Each record adds to one cell per dimension (key, user) and to one cell per distinct tag, so
a tag breakdown may count a request twice; the tenant's totals come from the ordinary cells.
Per tenant, dimension and period (UTC hour or day) at most MAX_NAMED values are kept by name,
the first to arrive; later new values in that period are summed under OTHER. Hour cells are
kept HOUR_RETENTION_S, day cells as long as the rest of the ledger.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from proxy.ledger.aggregate import DAY_S, Tally, period_start, roll_up
from proxy.ledger.base import ATTRIBUTES, UsageRecord

if TYPE_CHECKING:
    from proxy.ledger.base import UsageQuery

__all__ = [
    "HOUR_RETENTION_S",
    "MAX_NAMED",
    "OTHER",
    "AttrKey",
    "capped",
    "fold_attributes",
    "is_attribution",
]

OTHER = "(other)"
"""The group of the values past MAX_NAMED in a period (never a valid key id or tag)."""
MAX_NAMED = 100
HOUR_RETENTION_S = 8 * DAY_S
"""Hour cells by key, user and tag are kept 8 days (hour buckets over a week still work);
older windows are answered from day cells, widened to whole UTC days."""

AttrKey = tuple[str | None, int, str, str]
"""(tenant, period start, dimension, value); value '' is a request without one."""


def is_attribution(q: UsageQuery) -> bool:
    return q.group_by in ATTRIBUTES


def values_of(record: UsageRecord, dimension: str) -> tuple[str, ...]:
    if dimension == "key":
        return (record.key_id or "",)
    if dimension == "user":
        return (record.user or "",)
    return tuple(dict.fromkeys(record.tags)) or ("",)


def fold_attributes(
    records: Iterable[UsageRecord],
) -> tuple[dict[AttrKey, Tally], dict[AttrKey, Tally]]:
    """A batch's increments to the hour and day cells of every dimension (not yet capped)."""
    hours: dict[AttrKey, Tally] = {}
    for record in records:
        for key in _cells(record):
            _tally(hours, key).add(record)
        if record.supersedes is not None:  # the request's checkpoint is counted once, as now
            for key in _cells(record.supersedes):
                _tally(hours, key).withdraw(record.supersedes)
    return hours, roll_up(hours)


def _cells(record: UsageRecord) -> Iterator[AttrKey]:
    start = period_start(record.ts, "hour")
    for dimension in ATTRIBUTES:
        for value in values_of(record, dimension):
            yield (record.tenant, start, dimension, value)


def _tally(hours: dict[AttrKey, Tally], key: AttrKey) -> Tally:
    tally = hours.get(key)
    if tally is None:
        tally = hours[key] = Tally()
    return tally


Known = Callable[[str | None, int, str], Iterable[str]]
"""The values a store already keeps by name for (tenant, period start, dimension)."""


def capped(increments: dict[AttrKey, Tally], known: Known) -> dict[AttrKey, Tally]:
    """`increments` with each value past MAX_NAMED in its (tenant, period, dimension) moved to
    OTHER: what the SQLite writer stores (lua/append.lua does the same in Redis)."""
    out: dict[AttrKey, Tally] = {}
    named: dict[tuple[str | None, int, str], set[str]] = {}
    for (tenant, start, dimension, value), tally in increments.items():
        if value not in ("", OTHER):
            group = (tenant, start, dimension)
            names = named.get(group)
            if names is None:
                names = named[group] = {v for v in known(*group) if v not in ("", OTHER)}
            if value not in names:
                if len(names) < MAX_NAMED:
                    names.add(value)
                else:
                    value = OTHER
        key = (tenant, start, dimension, value)
        found = out.get(key)
        if found is None:
            out[key] = tally
        else:
            found.merge(tally)
    return out
