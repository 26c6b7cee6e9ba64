"""Requests in flight on a model's backends across replicas, read from the backends' shared
`max_concurrent` pools where this process's own count of them is no longer believed."""

from __future__ import annotations

import asyncio
import logging
import math

from proxy.clock import Clock
from proxy.routing.health import BackendHealth
from proxy.routing.pool import ModelPool
from proxy.storage.base import StorageError
from proxy.storage.limits import LimitKey, LimitStore
from proxy.storage.scopes import backend_scope

__all__ = ["RETRY_AFTER_FAILURE_S", "SharedInflight"]

RETRY_AFTER_FAILURE_S = 10.0
_log = logging.getLogger("tokenweir.degrade")


class SharedInflight:
    """A process learns a backend's count across replicas when it admits a request there, and
    believes it for SHARED_COUNT_S; one that admitted none there lately knew only its own
    requests (with two workers, each saw its share of a backend's load, and a rule on
    `inflight_ratio_above` or priority shedding went by that share)."""

    def __init__(self, store: LimitStore, clock: Clock) -> None:
        self._store = store
        self._clock = clock
        self._failed_s = -math.inf  # the last read that failed (monotonic)

    async def refresh(self, pool: ModelPool) -> None:
        """Read the count of each backend of `pool` whose count is stale (one read each, at
        once); a storage that does not answer leaves this process's own count, and is not
        asked again for a while (each request would wait out its timeout)."""
        now_s = self._clock.monotonic()
        if now_s - self._failed_s < RETRY_AFTER_FAILURE_S:
            return
        stale = [
            h for h in pool.members if h.backend.limits.max_concurrent and h.count_is_stale(now_s)
        ]
        if not stale:
            return
        counts = await asyncio.gather(*(self._held(h) for h in stale), return_exceptions=True)
        for health, held in zip(stale, counts, strict=True):
            if isinstance(held, StorageError):
                self._failed_s = now_s
                _log.debug("could not read %s's requests in flight: %s", health.name, held)
            elif isinstance(held, BaseException):
                raise held
            else:
                health.counted(held, now_s)

    async def _held(self, health: BackendHealth) -> int:
        backend = health.backend
        scope = backend_scope(backend.name)
        slots = LimitKey(scope, "slots").pool(backend.limits.max_concurrent or 0)
        (held,) = await self._store.held(scope, [slots], now=self._clock.wall())
        return held
