"""Waiting for several calls: together (overlapping) or in turn (already under way)."""

from __future__ import annotations

import asyncio

import pytest

from proxy.together import cancelled, in_turn, nothing

pytestmark = pytest.mark.anyio


async def test_in_turn_waits_for_every_call_and_raises_the_first_error() -> None:
    done: list[str] = []

    async def call(name: str, fails: bool = False) -> None:
        done.append(name)
        if fails:
            raise ValueError(name)

    with pytest.raises(ValueError, match="b"):
        await in_turn([call("a"), call("b", fails=True), call("c", fails=True), nothing()])
    assert done == ["a", "b", "c"]


async def test_cancelled_stops_a_task_that_lost_its_cancel() -> None:
    """A poller whose cancel a library dropped (as Python 3.11's wait_for does when its inner
    call finishes as the cancel comes) polls on; stopping it must still end, not wait for ever."""
    lost: list[str] = []

    async def poller() -> None:
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if lost:
                    raise
                lost.append("cancel")  # the first cancel is lost inside a "library call"

    task = asyncio.create_task(poller())
    await asyncio.sleep(0.05)
    stopping = asyncio.create_task(cancelled([task, None]))
    done, _ = await asyncio.wait([stopping], timeout=30)
    assert done == {stopping}, "cancelled() waited for ever on a task that lost one cancel"
    assert lost == ["cancel"]  # the first was lost, the second stopped it
    assert task.cancelled()


async def test_cancelled_drops_the_error_a_task_ends_with() -> None:
    async def fails_when_stopped() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            raise ValueError("while ending") from None

    task = asyncio.create_task(fails_when_stopped())
    await asyncio.sleep(0)
    await cancelled([task])
    assert isinstance(task.exception(), ValueError)
