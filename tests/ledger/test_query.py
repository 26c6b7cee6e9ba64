"""Query planning: whole days from day totals, the edges from hour totals, grouping into rows."""

from __future__ import annotations

import pytest

from proxy.ledger import UsageQuery
from proxy.ledger.aggregate import Cell, Tally
from proxy.ledger.query import Span, plan, rows, window
from tests.ledger.factory import DAY_S, HOUR_S, T0, record

DAY0 = int(T0 - T0 % DAY_S)


def test_window_widens_to_whole_hours() -> None:
    assert window(UsageQuery(None, T0 + 1, T0 + 2)) == (T0, T0 + HOUR_S)
    assert window(UsageQuery(None, T0, T0 + HOUR_S)) == (T0, T0 + HOUR_S)


def test_a_breakdown_widens_to_whole_days_only_the_edges_older_than_its_hours() -> None:
    """By key, user or tag, hour totals are kept 8 days before `now`: an edge older than that
    widens to its UTC day, a younger one stays whole hours; by model nothing widens."""
    old, recent = DAY0 - 20 * DAY_S, DAY0 - 2 * DAY_S
    by_key = UsageQuery(None, old + 5 * HOUR_S, old + 37 * HOUR_S, None, "key", now=T0)
    assert window(by_key) == (old, old + 2 * DAY_S)
    straddling = UsageQuery(None, old + 5 * HOUR_S, recent + 7 * HOUR_S, None, "key", now=T0)
    assert window(straddling) == (old, recent + 7 * HOUR_S)
    young = UsageQuery(None, recent + 5 * HOUR_S, recent + 7 * HOUR_S, None, "user", now=T0)
    assert window(young) == (recent + 5 * HOUR_S, recent + 7 * HOUR_S)
    by_model = UsageQuery(None, old + 5 * HOUR_S, old + 37 * HOUR_S, None, "model", now=T0)
    assert window(by_model) == (old + 5 * HOUR_S, old + 37 * HOUR_S)
    hours = UsageQuery(None, old + 5 * HOUR_S, old + 37 * HOUR_S, "hour", "tag", now=T0)
    assert window(hours) == (old + 5 * HOUR_S, old + 37 * HOUR_S)


def test_short_windows_read_hours_only() -> None:
    assert plan(UsageQuery(None, DAY0 + 600, DAY0 + DAY_S - 4000)) == [
        Span("hour", DAY0, DAY0 + 23 * 3600)
    ]
    assert plan(UsageQuery(None, DAY0 + 600, DAY0 + DAY_S - 600)) == [
        Span("day", DAY0, DAY0 + 86400)
    ]


def test_long_windows_read_days_in_the_middle() -> None:
    q = UsageQuery(None, DAY0 - 2 * HOUR_S - 5, DAY0 + 3 * DAY_S + 90)
    assert plan(q) == [
        Span("hour", DAY0 - 3 * 3600, DAY0),
        Span("day", DAY0, DAY0 + 3 * 86400),
        Span("hour", DAY0 + 3 * 86400, DAY0 + 3 * 86400 + 3600),
    ]
    assert plan(UsageQuery(None, DAY0, DAY0 + 2 * DAY_S)) == [Span("day", DAY0, DAY0 + 2 * 86400)]


def test_hour_buckets_always_read_hours() -> None:
    q = UsageQuery(None, DAY0, DAY0 + 2 * DAY_S, bucket="hour")
    assert plan(q) == [Span("hour", DAY0, DAY0 + 2 * 86400)]


def tally(requests: int) -> Tally:
    t = Tally()
    for i in range(requests):
        t.add(record(i))
    return t


def test_rows_sum_cells_by_tenant_bucket_and_key() -> None:
    cells = [
        Cell(("b", DAY0, "m1", "x"), tally(1)),
        Cell(("a", DAY0 + 3600, "m2", "x"), tally(2)),
        Cell(("a", DAY0, "m1", "y"), tally(3)),
        Cell((None, DAY0, None, None), tally(4)),
        Cell(("a", DAY0 + 86400, "m1", "x"), tally(5)),
    ]
    q = UsageQuery(None, DAY0, DAY0 + 2 * DAY_S, bucket="day", group_by="model")
    got = [(r.tenant, r.bucket_start, r.key, r.requests) for r in rows(q, cells)]
    assert got == [
        ("a", DAY0, "m1", 3),
        ("a", DAY0, "m2", 2),
        ("a", DAY0 + DAY_S, "m1", 5),
        ("b", DAY0, "m1", 1),
        (None, DAY0, None, 4),
    ]


@pytest.mark.parametrize(
    "kwargs",
    [{"since": 2.0, "until": 1.0}, {"bucket": "week"}, {"group_by": "tenant"}],
)
def test_invalid_queries_are_refused(kwargs: dict[str, object]) -> None:
    arguments: dict[str, object] = {"tenant": None, "since": 1.0, "until": 2.0} | kwargs
    with pytest.raises(ValueError, match=r"since|bucket|group_by"):
        UsageQuery(**arguments)  # type: ignore[arg-type]
