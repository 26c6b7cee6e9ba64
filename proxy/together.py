"""Await several independent calls at once, so their round trips overlap; stop background tasks."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable, Sequence

__all__ = ["cancelled", "in_turn", "nothing", "together"]

_RECANCEL_S = 0.1  # how long a cancelled task may take to end before it is cancelled again


async def together(calls: Sequence[Awaitable[None]]) -> None:
    """Wait for every call; one alone is awaited as it is (a task costs more than it saves).
    If one raises, the others still run to their end, and the first error is raised."""
    if len(calls) == 1:
        await calls[0]
    elif calls:
        await asyncio.gather(*calls)


async def cancelled(tasks: Iterable[asyncio.Task[None] | None]) -> None:
    """Cancel every task (None: none to stop) and wait until each has ended; an error a task
    raised while ending is dropped, as it is being stopped for good.

    A task still running a moment after its cancel is cancelled again: a library can lose a
    cancel (Python 3.11's `asyncio.wait_for`, which redis-py sends every command through,
    returns an inner result that finished as the cancel came and drops the cancel), and a poller
    that lost one would poll on while its owner waited for it for ever."""
    stopping = {task for task in tasks if task is not None}
    running = stopping
    while running:
        for task in running:
            task.cancel()
        _, running = await asyncio.wait(running, timeout=_RECANCEL_S)
    for task in stopping:  # retrieved, so none is reported as never retrieved
        if not task.cancelled():
            task.exception()


async def in_turn(calls: Sequence[Awaitable[None]]) -> None:
    """Wait for calls whose work is already under way (their storage calls made), one after
    another, with no task each; if one raises, the others are still waited for, and the first
    error is raised."""
    first: BaseException | None = None
    for call in calls:
        try:
            await call
        except BaseException as exc:
            first = first or exc
    if first is not None:
        raise first


async def nothing() -> None:
    """An awaitable with nothing left to do."""
