"""Totals below the tenant, per API key, end user and tag: folded at write time, bounded.

Each record adds to one cell per dimension (key, user) and to one cell per distinct tag, so
a tag breakdown may count a request twice; the tenant's totals come from the ordinary cells.
Per tenant, dimension and period (UTC hour or day) at most MAX_NAMED values are kept by name,
the first to arrive; later new values in that period are summed under OTHER. Hour cells are
kept HOUR_RETENTION_S, day cells as long as the rest of the ledger.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, NamedTuple, TypeVar

from proxy.ledger.aggregate import DAY_S, CellKey, Tally, period_start, roll_up
from proxy.ledger.base import ATTRIBUTES, UsageRecord

if TYPE_CHECKING:
    from proxy.ledger.base import UsageQuery

__all__ = [
    "HOUR_RETENTION_S",
    "MAX_NAMED",
    "OTHER",
    "AttrKey",
    "Folded",
    "capped",
    "fold",
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
_K = TypeVar("_K", bound=tuple[object, ...])


def is_attribution(q: UsageQuery) -> bool:
    return q.group_by in ATTRIBUTES


_Group = tuple[str | None, int, str | None, str | None, str, str, tuple[str, ...]]
"""(tenant, hour start, model, backend, key, user, distinct tags): the finest cell a record
adds to; '' (or ('',) for tags) is a request without one."""


class Folded(NamedTuple):
    """A batch's increments to every hour and day cell (attribution cells not yet capped)."""

    hours: dict[CellKey, Tally]
    days: dict[CellKey, Tally]
    attr_hours: dict[AttrKey, Tally]
    attr_days: dict[AttrKey, Tally]


def fold(records: Iterable[UsageRecord]) -> Folded:
    """A batch's increments. A record that supersedes a checkpoint takes the checkpoint's share
    back out, so a request counts once, as last seen.

    Each record is added once, to its finest cell; the cells the ledger stores (by model and
    backend, by key, user and tag) are then sums of those, so a batch's cost grows with its
    records' distinct (tenant, hour, model, backend, key, user, tags), not its records times
    the cells each lands in.
    """
    groups: dict[_Group, Tally] = {}
    for record in records:
        _tally(groups, _group_of(record)).add(record)
        if record.supersedes is not None:
            _tally(groups, _group_of(record.supersedes)).withdraw(record.supersedes)
    hours: dict[CellKey, Tally] = {}
    attr_hours: dict[AttrKey, Tally] = {}
    for (tenant, start, model, backend, key, user, tags), tally in groups.items():
        _tally(hours, (tenant, start, model, backend)).merge(tally)
        _tally(attr_hours, (tenant, start, "key", key)).merge(tally)
        _tally(attr_hours, (tenant, start, "user", user)).merge(tally)
        for tag in tags:
            _tally(attr_hours, (tenant, start, "tag", tag)).merge(tally)
    return Folded(hours, roll_up(hours), attr_hours, roll_up(attr_hours))


def _group_of(record: UsageRecord) -> _Group:
    tags = tuple(dict.fromkeys(record.tags)) if record.tags else ("",)
    return (
        record.tenant, period_start(record.ts, "hour"), record.model, record.backend,
        record.key_id or "", record.user or "", tags,
    )  # fmt: skip


def _tally(cells: dict[_K, Tally], key: _K) -> Tally:
    tally = cells.get(key)
    if tally is None:
        tally = cells[key] = Tally()
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
