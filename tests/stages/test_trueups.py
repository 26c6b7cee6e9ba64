"""Token-bucket true-ups storage did not take: sent again once it does if they never ran, never
when they may have (a true-up repeated would count twice), one per bucket, bounded."""

from __future__ import annotations

import asyncio
import time

import pytest

from proxy.stages import trueups as trueups_module
from proxy.stages.trueups import MissedTrueUps, TrueUp
from proxy.storage.base import StorageError, StorageRefused, StorageTimeout, StorageUnsent
from proxy.storage.limits import Bucket
from proxy.storage.memory.limits import MemoryLimitStore
from proxy.storage.redis.limits import RedisLimitStore
from tests.redis_server import RedisProcess

pytestmark = pytest.mark.anyio

SCOPE = "tw:{acme}"
TPM = Bucket("tw:{acme}:rl:tpm", capacity=1000, refill_per_s=1000 / 60)


class Failing(MemoryLimitStore):
    """Fails its next `failures` true-ups with `error` (the first fails as the request ends)."""

    def __init__(self, error: StorageError, failures: int) -> None:
        super().__init__()
        self.error, self.failures, self.calls = error, failures, 0

    async def settle(self, scope: str, bucket: Bucket, delta: int, *, now: float) -> None:
        self.calls += 1
        if self.failures > 0:
            self.failures -= 1
            raise self.error
        await super().settle(scope, bucket, delta, now=now)


async def _left(store: MemoryLimitStore, bucket: Bucket = TPM) -> int:
    (state,) = await store.peek(SCOPE, [bucket], now=time.time())
    return state.remaining


async def _reserved(store: MemoryLimitStore, bucket: Bucket = TPM) -> None:
    """A request took 950 tokens of the bucket."""
    await store.admit(SCOPE, [bucket], [950], [], lease_id="l", lease_until=0, now=time.time())


async def _missed(
    error: StorageError, failures: int, delta: int = -940
) -> tuple[Failing, MissedTrueUps]:
    """A request that took 950 tokens ends; its true-up of `delta` meets a store failing its next
    `failures` true-ups with `error`."""
    store = Failing(error, failures)
    true_ups = MissedTrueUps(store, time.time)
    await _reserved(store)
    await true_ups.sent(true_ups.send(SCOPE, TPM, delta, now=time.time()))
    return store, true_ups


async def _until_sent(true_ups: MissedTrueUps) -> None:
    async with asyncio.timeout(10):
        while true_ups.pending:  # noqa: ASYNC110 (polled: nothing to wait on)
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("error", [StorageUnsent("redis: refused"), StorageRefused("READONLY")])
async def test_a_true_up_that_never_ran_is_sent_again_once(error: StorageError) -> None:
    store, true_ups = await _missed(error, failures=3)
    assert true_ups.pending == 1
    await _until_sent(true_ups)
    assert await _left(store) >= 990  # given back, once (capped at the capacity)
    assert true_ups.counts["trued_late"] == 1
    assert store.calls == 4
    await true_ups.aclose()


async def test_a_true_up_that_may_have_run_is_not_sent_again() -> None:
    store, true_ups = await _missed(StorageTimeout("redis: timed out"), failures=1)
    assert (true_ups.pending, true_ups.counts["uncertain"]) == (0, 1)
    assert await _left(store) < 100
    await true_ups.aclose()


async def test_true_ups_are_kept_one_per_bucket_and_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(trueups_module, "MAX_BUCKETS", 1)
    other = Bucket("tw:{acme}:k:1:rl:tpm", capacity=1000, refill_per_s=1000 / 60)
    # two requests' true-ups of the same bucket: merged
    store, true_ups = await _missed(StorageUnsent("redis: refused"), failures=3, delta=-400)
    await true_ups.sent(true_ups.send(SCOPE, TPM, -500, now=time.time()))
    await true_ups.sent(true_ups.send(SCOPE, other, -10, now=time.time()))
    assert (true_ups.pending, true_ups.counts["dropped"]) == (1, 1)
    await _until_sent(true_ups)
    assert 950 <= await _left(store) <= 1000
    assert true_ups.counts["trued_late"] == 1
    await true_ups.aclose()


async def test_what_is_kept_is_sent_once_more_at_shutdown() -> None:
    store, true_ups = await _missed(StorageUnsent("redis: refused"), failures=1)
    await true_ups.aclose()  # at once: before the first resend
    assert await _left(store) >= 990
    assert (true_ups.pending, true_ups.counts["trued_late"]) == (0, 1)


async def test_a_true_up_being_sent_at_shutdown_is_counted() -> None:
    """SIGTERM while a kept true-up is being sent to a hung Redis (SIGSTOP): the send is stopped
    and the true-up was counted nowhere (not pending, not trued_late, not uncertain). Now it
    is `uncertain`: written, it may run when Redis wakes, so it is not sent again."""
    server = RedisProcess()
    server.start()
    store = RedisLimitStore(server.url, timeout_s=5.0)
    try:
        true_ups = MissedTrueUps(store, time.time)
        await true_ups.sent(_failed_call(StorageUnsent("redis: refused")))
        server.pause()
        await asyncio.sleep(0.5)  # sent again at 0.1 s: Redis holds it unanswered
        assert true_ups.pending == 1
        await true_ups.aclose()
        assert true_ups.counts == {"trued_late": 0, "uncertain": 1, "dropped": 0}
    finally:
        server.resume()
        await store.aclose()
        server.close()


def _failed_call(error: StorageError) -> TrueUp:
    """A true-up whose call did not reach storage, as `send` would return it."""

    async def failed() -> None:
        raise error

    return failed(), SCOPE, TPM, -940
