"""Active health checks: `GET /models` on every backend, periodically, from the lifespan."""

from __future__ import annotations

import asyncio
import logging

from proxy.routing.pool import Pools
from proxy.together import cancelled
from proxy.upstream.client import POOL_BUSY, UpstreamClient

__all__ = ["Prober"]

_log = logging.getLogger("tokenweir.routing")
_PROBE_TIMEOUT_S = 2.0


class Prober:
    """A backend whose probe fails is taken out of rotation until a probe succeeds again; a
    probe that found the gateway's own connection pool full changes nothing."""

    def __init__(self, pools: Pools, upstream: UpstreamClient, interval_s: float) -> None:
        self._pools = pools
        self._upstream = upstream
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    async def probe_once(self) -> None:
        healths = list(self._pools.health.values())
        timeout_s = min(_PROBE_TIMEOUT_S, self._interval_s or _PROBE_TIMEOUT_S)
        results = await asyncio.gather(
            *(self._upstream.probe(h.backend, timeout_s) for h in healths)
        )
        for health, problem in zip(healths, results, strict=True):
            if problem == POOL_BUSY:
                continue  # the gateway's own connections were all busy: the backend was not asked
            if problem != health.probe_error:
                if problem is None:
                    _log.info("backend %s answers its probe again", health.name)
                else:
                    _log.warning("backend %s failed its probe: %s", health.name, problem)
            health.probe_error = problem

    def start(self) -> None:
        if self._interval_s > 0 and self._task is None:
            self._task = asyncio.create_task(self._run())

    async def aclose(self) -> None:
        task, self._task = self._task, None
        await cancelled([task])

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.probe_once()
