"""Await several independent calls at once, so their round trips overlap."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence

__all__ = ["together"]


async def together(calls: Sequence[Awaitable[None]]) -> None:
    """Wait for every call; one alone is awaited as it is (a task costs more than it saves).
    If one raises, the others still run to their end, and the first error is raised."""
    if len(calls) == 1:
        await calls[0]
    elif calls:
        await asyncio.gather(*calls)
