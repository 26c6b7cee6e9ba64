"""Leases: ids no two share, renewed again and again while their request runs, never after."""

from __future__ import annotations

import asyncio
import logging

import pytest

from proxy.clock import FakeClock, SystemClock
from proxy.leases import Lease, LeaseIds, Renewal
from proxy.storage import StorageError

pytestmark = pytest.mark.anyio


async def test_a_lease_is_renewed_until_cancelled_and_a_failure_does_not_stop_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[int] = []
    third = asyncio.Event()

    async def renew() -> bool:
        calls.append(len(calls))
        if len(calls) == 1:
            raise StorageError("redis: down")
        if len(calls) == 3:
            third.set()
        return True

    with caplog.at_level(logging.WARNING, logger="tokenweir.test"):
        log = logging.getLogger("tokenweir.test")
        renewal = Renewal(renew, 0.03, SystemClock(), log, "a test lease")
        async with asyncio.timeout(30):  # a limit, not a measurement
            await third.wait()
        renewal.cancel()
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

    lease.keep(renew, clock, logging.getLogger("tokenweir.test"), "a test lease")
    await advance(9.9)
    assert untils == []  # not a third of the lease yet, however long the test takes
    await advance(0.1)
    assert untils == [1040.0]  # a lease's length after now on the clock
    await advance(25.0)  # two thirds more, each renewed at its time
    assert untils == [1040.0, 1050.0, 1060.0]
    lease.end()
    await advance(100.0)
    assert untils == [1040.0, 1050.0, 1060.0]  # none after the end


def test_lease_ids_are_unique_across_makers() -> None:
    one, two = LeaseIds(), LeaseIds()
    ids = [maker.next() for maker in (one, two) for _ in range(1000)]
    assert len(set(ids)) == len(ids)
