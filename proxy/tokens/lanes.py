"""Long counts in worker threads, at most a few of one tenant's at a time: a 4 MB prompt takes
seconds of CPU to tokenize, before any of the tenant's limits (which need its count) apply."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from functools import partial
from typing import TypeVar

from proxy.tokens.segments import counting_tenant

__all__ = ["LONG_COUNTS_PER_TENANT", "CountLanes"]

T = TypeVar("T")

# Of the default executor's min(32, cores + 4) threads, what one tenant's counts may hold.
LONG_COUNTS_PER_TENANT = 2


class CountLanes:
    """One lane per tenant counting now: its long counts wait for one of `per_tenant` places.
    A place is held until its thread is done, even when the request waiting for it went away
    (a thread cannot be stopped): a client cannot free its place by leaving."""

    __slots__ = ("_lanes", "_per_tenant")

    def __init__(self, per_tenant: int = LONG_COUNTS_PER_TENANT) -> None:
        self._per_tenant = per_tenant
        self._lanes: dict[str | None, _Lane] = {}

    def __len__(self) -> int:
        return len(self._lanes)

    async def run(self, count: Callable[..., T], *args: object) -> T:
        """`count(*args)` in a worker thread, in the counting tenant's context (its memory)."""
        tenant = counting_tenant()
        lane = self._lanes.get(tenant)
        if lane is None:
            lane = self._lanes[tenant] = _Lane(self._per_tenant)
        lane.users += 1
        try:
            await lane.places.acquire()
        except BaseException:
            self._leave(tenant, lane)
            raise
        call = partial(contextvars.copy_context().run, count, *args)
        future = asyncio.get_running_loop().run_in_executor(None, call)
        future.add_done_callback(partial(self._done, tenant, lane))
        return await asyncio.shield(future)

    def _done(self, tenant: str | None, lane: _Lane, future: asyncio.Future[object]) -> None:
        if not future.cancelled():
            future.exception()  # the waiter's to raise; seen here if it went away first
        lane.places.release()
        self._leave(tenant, lane)

    def _leave(self, tenant: str | None, lane: _Lane) -> None:
        lane.users -= 1
        if not lane.users and self._lanes.get(tenant) is lane:
            del self._lanes[tenant]


class _Lane:
    __slots__ = ("places", "users")

    def __init__(self, places: int) -> None:
        self.places = asyncio.Semaphore(places)
        self.users = 0
