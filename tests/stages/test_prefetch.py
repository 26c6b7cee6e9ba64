"""The admission stages' storage steps taken together: the stages decide as with their own calls
(refusal order, failure policy, stop_stream_at_budget), and storage sees one call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from proxy.clock import FakeClock
from proxy.context import Admitted
from proxy.cost import PriceTable
from proxy.errors import RateLimited, StorageUnavailable
from proxy.policy import parse_policy
from proxy.policy.model import Budget, CacheSpec, Limits, Tenant
from proxy.policy.units import hash_key
from proxy.stages.budget import Budgets
from proxy.stages.cache import ResponseCache
from proxy.stages.prefetch import Prefetch
from proxy.stages.ratelimit import RateLimits
from proxy.stages.storagepolicy import StorageFailures
from proxy.storage import Storage, StorageError, open_storage
from proxy.storage.joint import Step
from proxy.storage.limits import Bucket
from tests.contexts import admitted

pytestmark = pytest.mark.anyio

NOON = 1_800_000_000.0 - (1_800_000_000 % 86400) + 43200
POLICY = parse_policy(
    """
backends: [{name: b, url: "http://127.0.0.1:9/v1", models: [m]}]
models: {m: {price: {input_per_1m: 1.0, output_per_1m: 2.0}}}
tenants: {}
""",
    environ={},
)
TPM = Bucket("tw:{acme}:rl:tpm", capacity=10_000, refill_per_s=10_000 / 60)


class Counting(Storage):
    """Memory storage that counts its joint calls, or fails every one of them."""

    def __init__(self, failing: bool = False) -> None:
        memory = open_storage("memory")
        super().__init__(memory.quotas, memory.limits, memory.cache)
        self.calls = 0
        self.failing = failing

    async def admit(self, steps: Sequence[Step[Any]]) -> None:
        self.calls += 1
        if self.failing:
            for step in steps:
                step.failed(StorageError("redis: connection refused"))
            return
        await super().admit(steps)


class Gateway:
    """Prefetch and the stages after it, as the app wires them."""

    def __init__(self, storage: Storage) -> None:
        self.clock = FakeClock(start_wall=NOON)
        self.failures = StorageFailures()
        self.budgets = Budgets(storage.quotas, PriceTable(POLICY), self.clock, self.failures)
        self.limits = RateLimits(storage.limits, self.clock, self.failures)
        self.cache = ResponseCache(storage.cache, self.clock)
        self.stages = [
            Prefetch(storage, [self.budgets, self.limits, self.cache], self.failures),
            self.budgets, self.limits, self.cache,
        ]  # fmt: skip

    async def __call__(self, ctx: Admitted) -> None:
        for stage in self.stages:
            await stage(ctx)


def request(budget: Budget, limits: Limits, *, allowance: int | None = 50) -> Admitted:
    tenant = Tenant(
        api_keys=(hash_key("k"),), models=("m",), budget=budget, limits=limits,
        cache=CacheSpec(mode="exact"),
    )  # fmt: skip
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    return admitted(
        tenant, body, tenant_name="acme", received_wall=NOON, counted=100, allowance=allowance
    )


async def test_every_stage_answered_by_one_storage_call() -> None:
    storage = Counting()
    gateway = Gateway(storage)
    ctx = request(Budget(tokens_per_day=1000), Limits(requests_per_minute=10, max_concurrent=2))
    await gateway(ctx)
    assert storage.calls == 1
    assert ctx.reservation is not None
    assert ctx.rate_limits
    assert ctx.cache == "miss"
    assert dict(ctx.rate_limit_headers)[b"x-ratelimit-remaining-requests"] == b"9"


async def test_a_budget_refusal_comes_first_and_charges_no_rate_limit() -> None:
    gateway = Gateway(Counting())
    limits = Limits(requests_per_minute=10, max_concurrent=1)
    await gateway(request(Budget(tokens_per_day=200), limits))
    # The budget's refusal (the first holds the quota), though the slot is full too.
    with pytest.raises(RateLimited, match="Requests in flight hold this quota"):
        await gateway(request(Budget(tokens_per_day=200), limits))
    third = request(Budget(tokens_per_day=1000), limits)
    with pytest.raises(RateLimited) as refused:
        await gateway(third)
    assert "max_concurrent" in refused.value.message
    # Only the first request took one from the bucket: the one the budget refused took none.
    assert dict(third.rate_limit_headers)[b"x-ratelimit-remaining-requests"] == b"9"


async def test_a_failed_call_applies_each_stages_own_policy() -> None:
    gateway = Gateway(Counting(failing=True))
    limits = Limits(requests_per_minute=10)
    await gateway(request(Budget(tokens_per_day=1000), limits))
    assert gateway.failures.counts == {"quota:open": 1, "rate_limit:open": 1}
    with pytest.raises(StorageUnavailable):
        await gateway(request(Budget(tokens_per_day=1000), Limits(on_storage_error="closed")))
    assert gateway.failures.counts["quota:closed"] == 1


async def test_stop_stream_at_budget_plans_again_and_charges_the_shorter_answer() -> None:
    storage = Counting()
    gateway = Gateway(storage)
    budget = Budget(tokens_per_day=260, stop_stream_at_budget=True)
    limits = Limits(tokens_per_minute=TPM.capacity)
    await gateway(request(budget, limits))  # 150 of 260 held
    storage.calls = 0
    ctx = request(budget, limits)
    await gateway(ctx)
    assert storage.calls == 2  # refused at 150 output tokens, then 10 fit
    assert ctx.body["max_tokens"] == 10
    # The rate limit charged the shortened request: 100 in + 10 out, after 150 earlier.
    [state] = await storage.limits.peek("tw:{acme}", [TPM], now=NOON)
    assert state.remaining == TPM.capacity - 150 - 110


async def test_a_second_cache_run_looks_up_on_its_own() -> None:
    storage = Counting()
    gateway = Gateway(storage)
    ctx = request(Budget(), Limits())
    await gateway(ctx)
    ctx.cache_serve_stale = True  # a degradation rule's second lookup
    await gateway.cache(ctx)
    assert storage.calls == 1
    assert ctx.cache == "miss"
