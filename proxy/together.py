"""Await several independent calls at once, so their round trips overlap; stop background tasks."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable, Sequence

__all__ = ["cancelled", "in_turn", "nothing", "together"]


async def together(calls: Sequence[Awaitable[None]]) -> None:
    """Wait for every call; one alone is awaited as it is (a task costs more than it saves).
    If one raises, the others still run to their end, and the first error is raised."""
    if len(calls) == 1:
        await calls[0]
    elif calls:
        await asyncio.gather(*calls)


async def cancelled(tasks: Iterable[asyncio.Task[None] | None]) -> None:
    """Cancel every task (None: none to stop) and wait until each has ended; an error a task
    raised while ending is dropped, as it is being stopped for good."""
    running = [task for task in tasks if task is not None]
    for task in running:
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)


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
