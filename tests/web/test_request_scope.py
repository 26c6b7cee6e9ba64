"""A request's cancel scope: the client leaving stops the request at its next await, never
inside a shield (where its holds are released), and no later; other cancellations pass."""

from __future__ import annotations

import asyncio

import pytest

from proxy.asgi.cancel import RequestScope

pytestmark = pytest.mark.anyio


async def _cancel_from_another_task(scope: RequestScope) -> None:
    await asyncio.sleep(0)
    scope.cancel()


def _cancelled_soon() -> tuple[RequestScope, asyncio.Task[None]]:
    """A scope, and the task that cancels it once the caller waits."""
    scope = RequestScope()
    return scope, asyncio.create_task(_cancel_from_another_task(scope))


async def test_a_cancel_stops_the_work_and_ends_at_the_scope() -> None:
    steps: list[str] = []
    scope = RequestScope()
    with scope:
        canceller = asyncio.create_task(_cancel_from_another_task(scope))
        steps.append("waiting")
        await asyncio.Event().wait()  # never set: only the cancel ends it
        steps.append("woke")  # never reached
    steps.append("after the scope")
    await canceller
    assert steps == ["waiting", "after the scope"]
    assert scope.cancel_called
    # the task carries no cancellation on: it can still wait
    await asyncio.sleep(0)
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0


async def test_a_cancel_inside_a_shield_lands_at_the_next_wait_after_it() -> None:
    steps: list[str] = []
    scope = RequestScope()
    with scope:
        with scope.shielded():
            canceller = asyncio.create_task(_cancel_from_another_task(scope))
            await asyncio.sleep(0.01)  # the cancel comes meanwhile
            await canceller
            steps.append("shield finished its waits")
        steps.append("shield left")
        await asyncio.Event().wait()
        steps.append("woke")  # never reached
    assert steps == ["shield finished its waits", "shield left"]


async def test_a_cancel_pending_at_a_shield_s_end_never_outlives_the_scope() -> None:
    scope = RequestScope()
    with scope:
        with scope.shielded():
            scope.cancel()  # from the task itself, inside the shield
        # the scope ends before the task waits again
    await asyncio.sleep(0.01)  # would raise CancelledError if the cancel had leaked
    late = RequestScope()
    late.cancel()
    woke = False
    with late:  # a scope cancelled before it opened stops at its first wait
        await asyncio.sleep(0.01)
        woke = True
    assert not woke


async def test_a_cancel_after_the_scope_ended_does_nothing() -> None:
    scope = RequestScope()
    with scope:
        await asyncio.sleep(0)
    scope.cancel()
    await asyncio.sleep(0.01)
    assert scope.cancel_called


async def test_someone_else_s_cancellation_passes_through_the_scope() -> None:
    inside = asyncio.Event()

    async def request() -> None:
        with RequestScope():
            inside.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(request())
    await inside.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()


async def test_both_cancelling_the_task_is_not_swallowed_by_the_scope() -> None:
    inside = asyncio.Event()
    scope = RequestScope()

    async def request() -> None:
        with scope:
            inside.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(request())
    await inside.wait()
    scope.cancel()
    task.cancel()  # the server's own, at the same moment
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()


async def test_a_cancel_a_library_lost_is_delivered_again() -> None:
    """As redis-py's calls on Python 3.11 can (asyncio.wait_for drops a cancel that comes as
    its inner call finishes): the request must still stop, not go on to call its backend."""
    steps: list[str] = []
    scope, canceller = _cancelled_soon()
    with scope:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            steps.append("lost in a library")  # and the request goes on
        steps.append("waiting again")
        await asyncio.Event().wait()  # only a second delivery ends this
        steps.append("woke")  # never reached
    steps.append("after the scope")
    await canceller
    assert steps == ["lost in a library", "waiting again", "after the scope"]
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0  # both deliveries taken back
    await asyncio.sleep(0.2)  # and no later one comes after the scope


async def test_no_cancel_is_delivered_again_inside_a_shield() -> None:
    steps: list[str] = []
    scope, canceller = _cancelled_soon()
    with scope:
        try:
            await asyncio.Event().wait()
        finally:  # settling, for longer than a re-delivery's wait
            with scope.shielded():
                await asyncio.sleep(0.3)
                steps.append("settled")
    steps.append("after the scope")
    await canceller
    assert steps == ["settled", "after the scope"]
