"""Leases: ids no two share, renewed again and again while their request runs, never after."""

from __future__ import annotations

import asyncio
import logging

import pytest

from proxy.clock import FakeClock
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
        renewal = Renewal(renew, 0.03, logging.getLogger("tokenweir.test"), "a test lease")
        async with asyncio.timeout(30):  # a limit, not a measurement
            await third.wait()
        renewal.cancel()
        renewed = len(calls)
        await asyncio.sleep(0.1)  # several periods: none comes after the cancel
    assert len(calls) == renewed
    assert "could not renew a test lease: redis: down" in caplog.text


async def test_a_lease_is_held_until_its_length_after_now_on_the_injected_clock() -> None:
    clock = FakeClock(start_wall=1000.0)
    lease = Lease("tw:{acme}", "l1", 0.03)
    untils: list[float] = []
    twice = asyncio.Event()

    async def renew(until: float) -> bool:
        untils.append(until)
        clock.advance(5.0)
        if len(untils) == 2:
            twice.set()
        return True

    lease.keep(renew, clock, logging.getLogger("tokenweir.test"), "a test lease")
    async with asyncio.timeout(30):  # a limit, not a measurement
        await twice.wait()
    lease.end()
    renewed = len(untils)
    await asyncio.sleep(0.1)  # several periods: none comes after the end
    assert untils[:2] == pytest.approx([1000.03, 1005.03])
    assert len(untils) == renewed


def test_lease_ids_are_unique_across_makers() -> None:
    one, two = LeaseIds(), LeaseIds()
    ids = [maker.next() for maker in (one, two) for _ in range(1000)]
    assert len(set(ids)) == len(ids)
