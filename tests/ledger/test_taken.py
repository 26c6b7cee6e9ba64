"""The batches a Redis ledger writer keeps to send again after its Redis lost them."""

from __future__ import annotations

from proxy.ledger.taken import TakenBatches
from tests.ledger.factory import record


class _Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_the_batches_after_what_redis_still_holds_come_back_in_order() -> None:
    taken = TakenBatches(monotonic=_Clock())
    for seq in (1, 3, 4):
        taken.took("a", seq, [record(seq)])
    taken.took("b", 2, [record(2)])
    assert taken.last("a") == 4
    kept, whole = taken.after("a", 1)
    assert [b.seq for b in kept] == [3, 4]
    assert whole


def test_batches_dropped_for_age_or_size_are_not_claimed_whole() -> None:
    clock = _Clock()
    taken = TakenBatches(keep_s=30, max_records=3, monotonic=clock)
    taken.took("a", 1, [record(1)])
    clock.now_s = 31
    taken.took("a", 2, [record(2)])  # the first is older than 30 s: dropped
    kept, whole = taken.after("a", 0)
    assert [b.seq for b in kept] == [2]
    assert not whole
    taken.took("b", 3, [record(3), record(4), record(5)])  # 4 records kept: the oldest goes
    assert taken.after("a", 0) == ([], False)
    assert [b.seq for b in taken.after("b", 0)[0]] == [3]


def test_a_tenant_with_nothing_kept_asks_for_no_gap_check() -> None:
    """Its marker in Redis expires a day after its last batch: a gap found then (none was
    lost) was logged as records lost."""
    clock = _Clock()
    taken = TakenBatches(keep_s=30, monotonic=clock)
    taken.took("a", 1, [record(1)])
    clock.now_s = 31
    taken.took("b", 2, [record(2)])
    assert taken.last("a") is None
    assert taken.last("b") == 2
