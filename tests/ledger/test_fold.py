"""A batch's fold: what it adds to every hour and day cell, against adding record by record."""

from __future__ import annotations

import random

from proxy.ledger import UsageRecord
from proxy.ledger.aggregate import Tally, period_start
from proxy.ledger.attribution import fold
from tests.ledger.factory import HOUR_S, T0, record


def one_by_one(records: list[UsageRecord]) -> tuple[dict[object, Tally], dict[object, Tally]]:
    """Every hour cell of every dimension, each record added to (or, for a superseded
    checkpoint, taken out of) each cell it belongs to, one at a time."""
    cells: dict[object, Tally] = {}
    attr: dict[object, Tally] = {}

    def apply(r: UsageRecord, take_out: bool) -> None:
        start = period_start(r.ts, "hour")
        keys = [(r.tenant, start, "key", r.key_id or ""), (r.tenant, start, "user", r.user or "")]
        keys += [(r.tenant, start, "tag", tag) for tag in dict.fromkeys(r.tags or ("",))]
        for found, key in [(cells, (r.tenant, start, r.model, r.backend))] + [
            (attr, k) for k in keys
        ]:
            tally = found.setdefault(key, Tally())
            tally.withdraw(r) if take_out else tally.add(r)

    for r in records:
        apply(r, take_out=False)
        if r.supersedes is not None:
            apply(r.supersedes, take_out=True)
    return cells, attr


def test_a_mixed_batch_folds_to_the_sums_of_its_records() -> None:
    rng = random.Random(7)  # noqa: S311 (test data)
    records = []
    for n in range(400):
        fields: dict[str, object] = {
            "ts": T0 + rng.choice((0, 1, 2, 30)) * HOUR_S + n,
            "tenant": rng.choice(("alpha", "beta", None)),
            "model": rng.choice(("m1", "m2")),
            "backend": rng.choice(("b1", "b2", None)),
            "key_id": rng.choice(("k1", "k2", None)),
            "user": rng.choice(("u1", None)),
            "tags": rng.choice(((), ("a",), ("a", "b"), ("b", "a", "b"))),
            "status": rng.choice((200, 200, 429, 500)),
            "cost_nusd": rng.randrange(1, 10_000),
            "output_tokens": rng.randrange(0, 500),
            "ttft_ms": rng.choice((None, 5.0, 900.0)),
        }
        checkpoint = record(n, **(fields | {"checkpoint": True, "output_tokens": 3}))
        superseding = rng.random() < 0.2
        records.append(record(n, **fields, supersedes=checkpoint if superseding else None))

    hours, days, attr_hours, attr_days = fold(records)
    cells, attr = one_by_one(records)

    assert hours == cells
    assert attr_hours == attr
    # A day cell is the sum of its hours: T0 + 30 h is another UTC day than T0's.
    assert {key[1] for key in days} == {
        period_start(T0, "day"),
        period_start(T0 + 30 * HOUR_S, "day"),
    }
    for folded, by_hour in ((days, cells), (attr_days, attr)):
        for key, tally in folded.items():
            summed = Tally()
            for hour_key, hour_tally in by_hour.items():
                same = hour_key[0] == key[0] and hour_key[2:] == key[2:]
                if same and period_start(hour_key[1], "day") == key[1]:
                    summed.merge(hour_tally)
            assert tally == summed
