"""The SQLite writer adds each batch to the stored totals: however records are split into
batches, the hour, day and attribution rows are the sums of all of them, histograms included."""

from __future__ import annotations

import sqlite3

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.ledger import histogram, sqlschema
from proxy.ledger.aggregate import COUNTERS
from proxy.ledger.attribution import fold
from proxy.ledger.base import UsageRecord
from proxy.ledger.sqlattr import cell_row
from tests.ledger.factory import DAY_S, HOUR_S, T0, record

_TABLES = ("usage_hour", "usage_day", "usage_hour_attr", "usage_day_attr")


def _record(
    n: int, tenant: str | None, model: str | None, key: str | None, user: str | None,
    tags: tuple[str, ...], later: float, ttft: float | None, speed: float | None, status: int,
) -> UsageRecord:  # fmt: skip
    return record(
        n, ts=T0 + later, tenant=tenant, model=model, key_id=key, user=user, tags=tags,
        ttft_ms=ttft, tokens_per_s=speed, status=status, input_tokens=n, cost_nusd=7 * n,
    )  # fmt: skip


records = st.builds(
    _record,
    st.integers(0, 10_000),
    st.sampled_from(["alpha", "beta", None]),
    st.sampled_from(["mock-llm", "other", None]),
    st.sampled_from(["k1", "k2", None]),
    st.sampled_from(["u1", None]),
    st.lists(st.sampled_from(["red", "blue", "green"]), max_size=3).map(tuple),
    st.sampled_from([0.0, 0.5 * HOUR_S, 1.5 * HOUR_S, DAY_S + 1]),
    st.one_of(st.none(), st.floats(0.05, 200_000)),
    st.one_of(st.none(), st.floats(0.5, 100_000)),
    st.sampled_from([200, 429, 500]),
)


def stored(conn: sqlite3.Connection) -> dict[str, dict[tuple[object, ...], tuple[object, ...]]]:
    """Each totals table: key -> (counters, decoded histograms)."""
    out = {}
    for table in _TABLES:
        key = "model, backend" if table in _TABLES[:2] else "dimension, value"
        columns = (
            f"tenant, period_start, {key}, {', '.join(COUNTERS)}, ttft_ms_hist, tokens_per_s_hist"
        )
        rows = conn.execute(f"SELECT {columns} FROM {table}").fetchall()  # noqa: S608
        out[table] = {row[:4]: decoded(row) for row in rows}
    return out


def decoded(row: tuple[object, ...]) -> tuple[object, ...]:
    *values, ttft, speed = row[4:]
    assert isinstance(ttft, bytes)
    assert isinstance(speed, bytes)
    return (*values, histogram.decode(ttft), histogram.decode(speed))


def expected(
    all_records: list[UsageRecord],
) -> dict[str, dict[tuple[object, ...], tuple[object, ...]]]:
    """The totals of all the records folded at once (fewer than 100 values a group: no cap)."""
    out = {}
    for table, cells in zip(_TABLES, fold(all_records), strict=True):
        rows = [cell_row(key, tally) for key, tally in cells.items()]
        out[table] = {row[:4]: decoded(row) for row in rows}
    return out


@settings(
    max_examples=40,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(st.lists(records, min_size=1, max_size=60), st.lists(st.integers(1, 20), min_size=1))
def test_totals_are_the_same_however_records_are_batched(
    tmp_path_factory: pytest.TempPathFactory, all_records: list[UsageRecord], sizes: list[int]
) -> None:
    path = tmp_path_factory.mktemp("totals") / "ledger.db"
    conn = sqlschema.connect(path, busy_timeout_s=5.0, writer=True)
    try:
        done, turn = 0, 0
        while done < len(all_records):
            size = sizes[turn % len(sizes)]
            sqlschema.write_batch(conn, all_records[done : done + size], {})
            done, turn = done + size, turn + 1
        found = stored(conn)
    finally:
        conn.close()
    assert found == expected(all_records)
