"""`bounded`: every record's numbers and strings in the range both ledgers store, one field at a
time, and a record already in range passed on as it is (not copied)."""

from __future__ import annotations

import math
from dataclasses import fields

import pytest

from proxy.ledger import UsageRecord
from proxy.ledger.base import (
    MAX_RECORD_CHARS,
    MAX_RECORD_INT,
    MAX_RECORD_TAGS,
    MAX_TAG_CHARS,
    bounded,
)
from tests.ledger.factory import record

INTS = ("status", "input_tokens", "output_tokens", "cost_nusd", "saved_input_tokens",
        "saved_output_tokens", "saved_cost_nusd", "counted_input_tokens")  # fmt: skip
FLOATS = ("ttft_ms", "tokens_per_s", "duration_ms")
TEXTS = ("request_id", "tenant", "model", "backend", "operation", "error", "cache",
         "usage_source", "key_id", "user")  # fmt: skip

OUT_OF_RANGE = [
    *((name, value) for name in INTS for value in (-1, MAX_RECORD_INT + 1, True, 2.5, None)),
    *((name, value) for name in FLOATS for value in (math.inf, -math.inf, math.nan, 7, True)),
    ("duration_ms", 1e300),  # summed as an integer: a total neither ledger can hold
    ("duration_ms", -1.0),
    *((name, value) for name in TEXTS for value in ("x" * (MAX_RECORD_CHARS + 1), 5)),
    ("tags", ("t",) * (MAX_RECORD_TAGS + 1)),
    ("tags", ("a", "t" * (MAX_TAG_CHARS + 1))),
]


def in_range(stored: UsageRecord) -> None:
    for name in INTS:
        value = getattr(stored, name)
        assert type(value) is int, name
        assert 0 <= value <= MAX_RECORD_INT, name
    for name in FLOATS:
        value = getattr(stored, name)
        assert value is None or (type(value) is float and math.isfinite(value)), name
    assert 0.0 <= stored.duration_ms <= MAX_RECORD_INT
    for name in TEXTS:
        value = getattr(stored, name)
        assert value is None or (type(value) is str and len(value) <= MAX_RECORD_CHARS), name
    tags = stored.tags
    assert len(tags) <= MAX_RECORD_TAGS
    assert all(len(t) <= MAX_TAG_CHARS for t in tags)


@pytest.mark.parametrize(("name", "value"), OUT_OF_RANGE, ids=repr)
def test_each_field_out_of_range_is_brought_into_it_and_no_other_changes(
    name: str, value: object
) -> None:
    given = record(1, **{name: value})
    stored = bounded(given)
    assert stored is not given
    in_range(stored)
    for other in fields(given):
        if other.name != name:
            assert getattr(stored, other.name) == getattr(given, other.name), other.name


def test_a_record_at_the_edges_of_the_range_is_passed_on_as_it_is() -> None:
    edges = record(
        1, status=0, input_tokens=MAX_RECORD_INT, cost_nusd=0, ttft_ms=None, tokens_per_s=0.0,
        duration_ms=float(MAX_RECORD_INT), model="m" * MAX_RECORD_CHARS, error="", user=None,
        tags=("t" * MAX_TAG_CHARS,) * MAX_RECORD_TAGS,
    )  # fmt: skip
    assert bounded(edges) is edges
