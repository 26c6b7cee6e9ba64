"""A command's event loop, on which Ctrl-C is never lost.

`asyncio.run` takes Ctrl-C by cancelling the command's task once. On Python 3.11 a cancel that
arrives as `asyncio.wait_for` sees what it waits on complete is swallowed (CPython gh-86296, fixed
in 3.12), and redis-py waits on its connection that way: `tokenweir report` interrupted as its
Redis connection opened ran on to its 5 s read timeout and exited 1, in 9 runs of 12. Here the
cancel is sent again until the work has stopped."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["run"]

T = TypeVar("T")

AGAIN_AFTER_S = 1.0
"""How long a cancelled command has to stop before it is cancelled again: long enough for its
clean-up (closing connections), short against the read timeouts a swallowed cancel runs into."""


def run(
    main: Coroutine[Any, Any, T],
    *,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
) -> T:
    """`asyncio.run(main)`; Ctrl-C raises KeyboardInterrupt once `main` has stopped."""
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(_until_stopped(main))


async def _until_stopped(main: Coroutine[Any, Any, T]) -> T:
    work = asyncio.ensure_future(main)
    try:
        await asyncio.wait({work})
    except asyncio.CancelledError:  # Ctrl-C: the runner cancelled this task
        while not work.done():
            work.cancel()
            await asyncio.wait({work}, timeout=AGAIN_AFTER_S)
        if not work.cancelled():
            work.exception()  # retrieved: what it ended with is not what the user is told
        raise
    return work.result()
