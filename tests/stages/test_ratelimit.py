"""Rate limits on memory storage with a fake clock: buckets, slots, the FIFO line, headers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.clock import FakeClock
from proxy.context import Admitted
from proxy.errors import RateLimited, StorageUnavailable
from proxy.policy.model import Limits, LimitSet, Tenant
from proxy.policy.units import hash_key
from proxy.stages.ratelimit import RateLimits, format_reset
from proxy.stages.storagepolicy import StorageFailures
from proxy.storage import MemoryLimitStore, StorageError
from tests.contexts import admitted

pytestmark = pytest.mark.anyio


def request(limits: Limits, *, counted: int = 100, allowance: int = 50) -> Admitted:
    tenant = Tenant(api_keys=(hash_key("k"),), models=("m",), limits=limits)
    return admitted(tenant, tenant_name="acme", counted=counted, allowance=allowance)


def headers(ctx: Admitted) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in ctx.rate_limit_headers}


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.0, "0ms"), (0.0201, "21ms"), (1.0, "1s"), (2.3, "3s"), (360, "6m0s"), (3723, "1h2m3s")],
)
def test_reset_durations_are_written_as_openai_does(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text


async def test_requests_per_minute_bursts_then_refuses_with_retry_after() -> None:
    clock = FakeClock(start_wall=1000.0)
    stage = RateLimits(MemoryLimitStore(), clock, StorageFailures())
    limits = Limits(requests_per_minute=3)
    for remaining in (2, 1, 0):
        ctx = request(limits)
        await stage(ctx)
        assert headers(ctx)["x-ratelimit-remaining-requests"] == str(remaining)
        assert headers(ctx)["x-ratelimit-limit-requests"] == "3"
    refused = request(limits)
    with pytest.raises(RateLimited) as caught:
        await stage(refused)
    error = caught.value
    assert (error.status, error.code) == (429, "rate_limit_exceeded")
    assert "requests_per_minute: limit 3" in error.message
    assert "try again in 20s" in error.message  # one request refills every 20 s
    assert error.headers() == {"retry-after": "20", "retry-after-ms": "20000"}
    assert headers(refused)["x-ratelimit-reset-requests"] == "1m0s"
    clock.advance(20)
    await stage(request(limits))


async def test_tokens_per_minute_settles_to_actual_usage() -> None:
    clock = FakeClock(start_wall=1000.0)
    stage = RateLimits(MemoryLimitStore(), clock, StorageFailures())
    limits = Limits(tokens_per_minute=300)
    ctx = request(limits)  # charged 100 input + 50 output
    await stage(ctx)
    assert headers(ctx)["x-ratelimit-remaining-tokens"] == "150"
    ctx.input_tokens, ctx.output_tokens = 100, 10
    await stage.settle(ctx)  # 40 refunded
    second = request(limits)
    await stage(second)
    assert headers(second)["x-ratelimit-remaining-tokens"] == "40"
    with pytest.raises(RateLimited, match="can never be admitted"):
        await stage(request(limits, counted=400))


async def test_max_concurrent_slots_are_released_when_settled() -> None:
    stage = RateLimits(MemoryLimitStore(), FakeClock(), StorageFailures())
    limits = Limits(max_concurrent=2)
    first, second = request(limits), request(limits)
    await stage(first)
    await stage(second)
    with pytest.raises(RateLimited, match="max_concurrent: 2 requests in flight"):
        await stage(request(limits))
    await stage.settle(first)
    await stage(request(limits))
    await stage.settle(second)


async def test_queue_timeout_waits_in_line_for_a_slot() -> None:
    stage = RateLimits(MemoryLimitStore(), FakeClock(), StorageFailures())
    limits = Limits(max_concurrent=1, queue_timeout=5.0)
    holder = request(limits)
    await stage(holder)
    waiters = [request(limits) for _ in range(3)]
    tasks = [asyncio.create_task(stage(w)) for w in waiters]
    await asyncio.sleep(0.01)
    assert not any(t.done() for t in tasks)
    await stage.settle(holder)
    for position, (waiter, task) in enumerate(zip(waiters, tasks, strict=True)):
        await asyncio.wait_for(task, timeout=2)  # first in line, first admitted
        assert all(not t.done() for t in tasks[position + 1 :])
        await stage.settle(waiter)


async def test_queue_gives_up_at_its_timeout() -> None:
    clock = FakeClock()
    stage = RateLimits(MemoryLimitStore(), clock, StorageFailures())
    limits = Limits(max_concurrent=1, queue_timeout=2.0)
    await stage(request(limits))
    waiting = asyncio.create_task(stage(request(limits)))
    await asyncio.sleep(0.01)
    clock.advance(2.5)
    with pytest.raises(RateLimited):
        await asyncio.wait_for(waiting, timeout=2)


async def test_per_model_limits_apply_on_top_of_the_tenants() -> None:
    stage = RateLimits(MemoryLimitStore(), FakeClock(start_wall=1000.0), StorageFailures())
    limits = Limits(requests_per_minute=10, per_model={"m": LimitSet(requests_per_minute=1)})
    ctx = request(limits)
    await stage(ctx)
    assert headers(ctx)["x-ratelimit-remaining-requests"] == "0"  # the tighter of the two
    with pytest.raises(RateLimited, match="requests_per_minute on model m: limit 1"):
        await stage(request(limits))
    other = request(limits)
    other.outgoing.set_model("n")
    await stage(other)
    assert headers(other)["x-ratelimit-remaining-requests"] == "8"


async def test_limits_a_reload_changes_apply_from_the_next_request() -> None:
    """The stage builds a tenant's buckets once; a reloaded policy's limits are new objects."""
    stage = RateLimits(MemoryLimitStore(), FakeClock(start_wall=1000.0), StorageFailures())
    before = request(Limits(requests_per_minute=10, max_concurrent=5))
    await stage(before)
    assert headers(before)["x-ratelimit-limit-requests"] == "10"
    assert [pool.size for pool in before.rate_limits[0].slots] == [5]
    after = request(Limits(requests_per_minute=3, tokens_per_minute=1000))
    await stage(after)
    assert headers(after)["x-ratelimit-limit-requests"] == "3"
    assert headers(after)["x-ratelimit-limit-tokens"] == "1000"
    assert after.rate_limits[0].slots == ()


async def test_one_tenants_line_never_delays_another_tenant() -> None:
    stage = RateLimits(MemoryLimitStore(), FakeClock(), StorageFailures())
    limits = Limits(max_concurrent=1, queue_timeout=30.0)
    await stage(request(limits))
    stuck = [asyncio.create_task(stage(request(limits))) for _ in range(20)]
    await asyncio.sleep(0.01)
    other = request(limits)
    other.tenant_name = "globex"
    await asyncio.wait_for(stage(other), timeout=1)  # admitted at once, past acme's line
    assert other.rate_limits
    for task in stuck:
        task.cancel()
    await asyncio.gather(*stuck, return_exceptions=True)


class Unreachable:
    async def admit(self, *args: Any, **kwargs: Any) -> None:
        raise StorageError("connection refused")


async def test_storage_failure_follows_the_tenants_policy_and_is_counted() -> None:
    failures = StorageFailures()
    stage = RateLimits(Unreachable(), FakeClock(), failures)  # type: ignore[arg-type]
    admitted = request(Limits(requests_per_minute=1))
    await stage(admitted)
    assert admitted.rate_limits == []
    closed = Limits(requests_per_minute=1, on_storage_error="closed")
    with pytest.raises(StorageUnavailable):
        await stage(request(closed))
    assert failures.counts == {"rate_limit:open": 1, "rate_limit:closed": 1}
    assert failures.last_error == "connection refused"


def test_the_store_keys_are_those_every_replica_shares() -> None:
    """Replicas of older versions on the same Redis count on the same keys."""
    stage = RateLimits(MemoryLimitStore(), FakeClock(start_wall=1000.0), StorageFailures())
    per_model = LimitSet(requests_per_minute=1, tokens_per_minute=5, max_concurrent=1)
    limits = Limits(
        requests_per_minute=10, tokens_per_minute=100, max_concurrent=2,
        per_model={"qwen:7b": per_model},
    )  # fmt: skip
    ctx = request(limits)
    ctx.outgoing.set_model("qwen:7b")
    plan = stage.plan(ctx)
    assert plan is not None
    assert [b.key for b in plan.shape.buckets] == [
        "tw:{acme}:rl:rpm", "tw:{acme}:rl:tpm",
        "tw:{acme}:rl:m:qwen:7b:rpm", "tw:{acme}:rl:m:qwen:7b:tpm",
    ]  # fmt: skip
    assert [p.key for p in plan.hold.slots] == [
        "tw:{acme}:rl:slots",
        "tw:{acme}:rl:m:qwen:7b:slots",
    ]
