"""A backend's requests in flight across replicas, read from storage where this process's own
count is stale, and not read again for a while once storage fails."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from proxy.clock import FakeClock
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from proxy.routing import Pools
from proxy.stages.inflight import RETRY_AFTER_FAILURE_S, SharedInflight
from proxy.storage import StorageError
from proxy.storage.limits import SlotPool
from proxy.storage.memory.limits import MemoryLimitStore

pytestmark = pytest.mark.anyio

POLICY = f"""
backends:
  - {{name: a, url: "http://127.0.0.1:1/v1", models: [m], limits: {{max_concurrent: 10}}}}
  - {{name: b, url: "http://127.0.0.1:2/v1", models: [m]}}
models: {{m: {{}}}}
tenants: {{t: {{api_keys: [{hash_key("k")}], models: [m]}}}}
"""


class Store(MemoryLimitStore):
    """Says every pool holds `held` leases, or fails; counts the reads."""

    def __init__(self, held: int) -> None:
        super().__init__()
        self.held_now: int | None = held
        self.reads = 0

    async def held(self, scope: str, slots: Sequence[SlotPool], *, now: float) -> tuple[int, ...]:
        self.reads += 1
        if self.held_now is None:
            raise StorageError("down")
        return tuple(self.held_now for _ in slots)


async def test_a_stale_count_is_read_once_and_believed_for_a_while() -> None:
    clock, store = FakeClock(), Store(7)
    pools = Pools(parse_policy(POLICY, environ={}), clock)
    inflight = SharedInflight(store, clock)
    pool = pools.pool("m")
    assert pool.inflight_ratio(clock.monotonic()) == 0.0  # its own: none
    await inflight.refresh(pool)
    await inflight.refresh(pool)
    assert store.reads == 1  # only `a` has max_concurrent, and its count is fresh now
    assert pool.inflight_ratio(clock.monotonic()) == 0.7


async def test_storage_that_fails_is_not_asked_again_for_a_while() -> None:
    """Every request needing the ratio would otherwise wait out the storage's timeout."""
    clock, store = FakeClock(), Store(7)
    store.held_now = None
    pool = Pools(parse_policy(POLICY, environ={}), clock).pool("m")
    inflight = SharedInflight(store, clock)
    await inflight.refresh(pool)
    clock.advance(RETRY_AFTER_FAILURE_S / 2)
    await inflight.refresh(pool)
    assert (store.reads, pool.inflight_ratio(clock.monotonic())) == (1, 0.0)
    store.held_now = 3
    clock.advance(RETRY_AFTER_FAILURE_S)
    await inflight.refresh(pool)
    assert (store.reads, pool.inflight_ratio(clock.monotonic())) == (2, 0.3)
