"""Token-bucket true-ups that storage did not take when a request ended: kept (bounded, one per
bucket, in this process's memory) and sent again in the background until storage takes them.

A true-up is not safe to repeat (it adds to the bucket), so only one that never ran is kept: its
call reached no storage (StorageUnsent) or Redis refused the write (StorageRefused). One that may
have run (a timeout, a lost connection) is dropped and counted `uncertain`, as the admission's
undo (storagepolicy.py) and the quotas' kept settles (unbooked.py) tell them apart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from proxy.storage.base import StorageError, StorageRefused, StorageUnsent
from proxy.storage.limits import Bucket, LimitStore
from proxy.together import cancelled

__all__ = ["MAX_BUCKETS", "MissedTrueUps", "TrueUp"]

_log = logging.getLogger("tokenweir.ratelimit")
MAX_BUCKETS = 10_000  # buckets with a true-up kept; one more is dropped (logged, counted)
_WITHIN_S = 60.0  # a per-minute bucket has refilled whole by then: a late true-up is moot
_FIRST_DELAY_S, _MAX_DELAY_S = 0.1, 2.0
TrueUp = tuple[Awaitable[None], str, Bucket, int]  # the call made, and its scope, bucket, delta


@dataclass(slots=True)
class _Missed:
    scope: str
    bucket: Bucket
    delta: int
    until: float  # monotonic


class MissedTrueUps:
    """`send` makes a true-up's call, `sent` waits for it; if storage did not take it (and it
    never ran), it is kept, merged with any other kept for the same bucket, and sent again with
    backoff until storage takes it or the bucket has refilled anyway."""

    def __init__(self, store: LimitStore, wall: Callable[[], float]) -> None:
        self._store = store
        self._wall = wall
        self._kept: dict[str, _Missed] = {}  # by bucket key
        self._sending = 0  # taken from _kept for the send under way
        self.counts: dict[str, int] = dict.fromkeys(("trued_late", "uncertain", "dropped"), 0)
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def pending(self) -> int:
        return len(self._kept) + self._sending

    def stats(self) -> dict[str, int]:
        """Buckets with a true-up kept now (`pending`), and by outcome since the start:
        `trued_late`, `uncertain` (it may have run: not sent again), `dropped` (never taken:
        past MAX_BUCKETS, or at shutdown)."""
        return {"pending": self.pending, **self.counts}

    def send(self, scope: str, bucket: Bucket, delta: int, *, now: float) -> TrueUp:
        """Charge `bucket` `delta` more tokens (refund if < 0): the call is made now."""
        return self._store.settle(scope, bucket, delta, now=now), scope, bucket, delta

    async def sent(self, true_up: TrueUp) -> None:
        """Wait for the true-up's call; keep it to send again if storage did not take it."""
        call, scope, bucket, delta = true_up
        try:
            await call
        except StorageError as exc:
            self._keep(scope, bucket, delta, exc)

    def _keep(self, scope: str, bucket: Bucket, delta: int, error: StorageError) -> None:
        if self._closing:  # a request that ended after the last send: nothing sends it now
            self.counts["dropped"] += 1
            _log.warning("shutdown: could not true up the token bucket of %s: %s", scope, error)
            return
        if not isinstance(error, StorageUnsent | StorageRefused):
            self.counts["uncertain"] += 1  # it may have run: sent again, it could count twice
            _log.warning("could not true up the token bucket of %s: %s", scope, error)
            return
        missed = self._kept.get(bucket.key)
        if missed is not None:
            missed.delta += delta
        elif len(self._kept) >= MAX_BUCKETS:
            self.counts["dropped"] += 1
            _log.warning("could not true up the token bucket of %s: %s", scope, error)
            return
        else:
            until = asyncio.get_running_loop().time() + _WITHIN_S
            self._kept[bucket.key] = _Missed(scope, bucket, delta, until)
        _log.warning("could not true up the token bucket of %s yet: %s", scope, error)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._retry())

    async def _retry(self) -> None:
        loop = asyncio.get_running_loop()
        delay_s = _FIRST_DELAY_S
        while self._kept:
            await asyncio.sleep(delay_s)
            now = loop.time()
            self._kept = {key: m for key, m in self._kept.items() if m.until > now}
            took = await self._send()
            delay_s = _FIRST_DELAY_S if took else min(delay_s * 2, _MAX_DELAY_S)

    async def _send(self) -> bool:
        """Send every kept true-up once, together; True if storage took any."""
        batch, self._kept = self._kept, {}
        wall = self._wall()
        calls = [self._store.settle(m.scope, m.bucket, m.delta, now=wall) for m in batch.values()]
        self._sending = len(batch)
        try:
            results = await asyncio.gather(*calls, return_exceptions=True)
        except asyncio.CancelledError:  # shutdown: written, they may have run: not sent again
            self.counts["uncertain"] += len(batch)
            raise
        finally:
            self._sending = 0
        took = False
        for (key, missed), result in zip(batch.items(), results, strict=True):
            if isinstance(result, StorageUnsent | StorageRefused):
                again = self._kept.setdefault(key, missed)
                if again is not missed:  # a request ended meanwhile and kept its own
                    again.delta += missed.delta
            elif isinstance(result, StorageError):
                self.counts["uncertain"] += 1
            elif isinstance(result, BaseException):
                raise result
            else:
                took = True
                self.counts["trued_late"] += 1
        return took

    async def aclose(self) -> None:
        """Shutdown: send what is kept one last time (other replicas share the buckets)."""
        self._closing = True
        if self._task is not None:
            await cancelled([self._task])
        if self._kept:
            await self._send()
        self.counts["dropped"] += len(self._kept)
        self._kept = {}
