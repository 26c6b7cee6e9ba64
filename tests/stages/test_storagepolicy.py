"""When shared storage fails: what a call that timed out, or lost its connection, may have taken
is given back; a call that never reached the storage took nothing, so nothing is undone."""

from __future__ import annotations

import asyncio

import pytest

from proxy.stages.storagepolicy import StorageFailures
from proxy.storage import StorageError, StorageTimeout, StorageUnreachable, StorageUnsent

pytestmark = pytest.mark.anyio


async def test_only_what_a_call_that_reached_the_storage_may_have_taken_is_given_back() -> None:
    failures = StorageFailures()
    undone: dict[str, int] = {"timeout": 0, "lost": 0, "unsent": 0, "error reply": 0}
    twice = asyncio.Event()

    def undo(what: str) -> asyncio.Future[None]:
        async def give_back() -> None:
            undone[what] += 1
            if undone["timeout"] == undone["lost"] == 2:
                twice.set()

        return asyncio.ensure_future(give_back())

    failures.undo_later(StorageUnsent("redis: refused"), lambda: undo("unsent"), 10.0)
    failures.undo_later(StorageUnreachable("redis: lost"), lambda: undo("lost"), 10.0)
    failures.undo_later(StorageError("redis: WRONGTYPE"), lambda: undo("error reply"), 10.0)
    failures.undo_later(StorageTimeout("redis: Timeout"), lambda: undo("timeout"), 10.0)
    try:
        # Sent once the storage answers, and once more for a call that reached it after that.
        await asyncio.wait_for(twice.wait(), 5.0)
    finally:
        await failures.aclose()
    assert undone == {"timeout": 2, "lost": 2, "unsent": 0, "error reply": 0}
