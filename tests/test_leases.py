"""Leases: ids no two share, renewed again and again while their request runs, never after."""

from __future__ import annotations

import asyncio
import itertools
import logging

import pytest

from proxy.clock import FakeClock, SystemClock
from proxy.leases import Lease, LeaseIds, Renewals
from proxy.storage import StorageError

pytestmark = pytest.mark.anyio


async def test_a_lease_is_renewed_until_cancelled_and_a_failure_does_not_stop_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[int] = []
    third = asyncio.Event()

    async def renew(until: float) -> bool:
        calls.append(len(calls))
        if len(calls) == 1:
            raise StorageError("redis: down")
        if len(calls) == 3:
            third.set()
        return True

    with caplog.at_level(logging.WARNING, logger="tokenweir.test"):
        log = logging.getLogger("tokenweir.test")
        lease = Lease("tw:{acme}", "l1", 0.03)
        Renewals(SystemClock(), log, "a test lease").keep(lease, renew)
        async with asyncio.timeout(30):  # a limit, not a measurement
            await third.wait()
        lease.end()
        renewed = len(calls)
        await asyncio.sleep(0.1)  # several periods: none comes after the cancel
    assert len(calls) == renewed
    assert "could not renew a test lease: redis: down" in caplog.text


async def test_a_lease_is_renewed_as_the_injected_clock_passes_thirds_of_its_length() -> None:
    clock = FakeClock(start_wall=1000.0)
    lease = Lease("tw:{acme}", "l1", 30.0)
    untils: list[float] = []

    async def renew(until: float) -> bool:
        untils.append(until)
        return True

    async def advance(seconds: float) -> None:
        clock.advance(seconds)
        for _ in range(3):  # the renewals the timers started run
            await asyncio.sleep(0)

    Renewals(clock, logging.getLogger("tokenweir.test"), "a test lease").keep(lease, renew)
    await advance(9.9)
    assert untils == []  # not a third of the lease yet, however long the test takes
    await advance(0.1)
    assert untils == [1040.0]  # a lease's length after now on the clock
    await advance(25.0)  # two thirds more, each renewed at its time
    assert untils == [1040.0, 1050.0, 1060.0]
    lease.end()
    await advance(100.0)
    assert untils == [1040.0, 1050.0, 1060.0]  # none after the end


async def test_leases_taken_at_any_time_are_each_renewed_before_half_their_length() -> None:
    """One timer serves every lease of a length: whenever a lease was taken, and also after a
    spell with none kept, each is renewed between a third and a half of its length after it
    was taken or last renewed, and never once it ended."""
    clock = FakeClock(start_wall=0.0)
    renewals = Renewals(clock, logging.getLogger("tokenweir.test"), "a test lease")
    renewed: dict[str, list[float]] = {}

    def keep(lease_id: str, lease_s: float = 60.0) -> Lease:
        lease = Lease("tw:{acme}", lease_id, lease_s)
        renewed[lease_id] = [clock.wall()]  # taken now

        async def renew(until: float) -> bool:
            renewed[lease_id].append(until - lease_s)  # until: a lease's length after then
            return True

        renewals.keep(lease, renew)
        return lease

    async def advance(seconds: float) -> None:
        for _ in range(int(seconds * 10)):  # a tenth of a second at a time
            clock.advance(0.1)
            await asyncio.sleep(0)

    early = keep("early")
    await advance(7.3)
    late, short = keep("late"), keep("short", 6.0)
    await advance(200.0)
    early.end()
    await advance(100.0)
    late.end()
    short.end()
    await advance(100.0)  # every lease ended: the timer stops
    again = keep("again")
    await advance(70.0)
    again.end()
    ends = {"early": 207.3, "late": 307.3, "short": 307.3, "again": 477.3}
    lengths = {"short": 6.0}
    for lease_id, times in renewed.items():
        lease_s = lengths.get(lease_id, 60.0)
        gaps = [b - a for a, b in itertools.pairwise(times)]
        gaps.append(ends[lease_id] - times[-1])  # from the last renewal to the end
        assert all(gap <= lease_s / 2 + 1e-6 for gap in gaps), (lease_id, gaps)
        assert all(gap >= lease_s / 3 - 1e-6 for gap in gaps[:-1]), (lease_id, gaps)
        assert times[-1] <= ends[lease_id]


def test_lease_ids_are_unique_across_makers() -> None:
    one, two = LeaseIds(), LeaseIds()
    ids = [maker.next() for maker in (one, two) for _ in range(1000)]
    assert len(set(ids)) == len(ids)
