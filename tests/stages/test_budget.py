"""Quotas: reserve before, settle after; refusals are OpenAI's insufficient_quota, with reset."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from proxy.clock import FakeClock
from proxy.context import Admitted
from proxy.cost import PriceTable
from proxy.errors import InsufficientQuota, RateLimited, StorageUnavailable
from proxy.outgoing import DEFAULT_OUTPUT_BOUND
from proxy.policy import Policy, parse_policy
from proxy.policy.model import Budget, Limits, Tenant
from proxy.policy.units import hash_key
from proxy.stages.budget import Budgets
from proxy.stages.storagepolicy import StorageFailures
from proxy.storage import Counter, MemoryStore, StorageError
from tests.contexts import admitted

# 2027-01-15 12:00 UTC
NOON = 1_800_000_000.0 - (1_800_000_000 % 86400) + 43200

POLICY: Policy = parse_policy(
    """
backends: [{name: b, url: "http://127.0.0.1:9/v1", models: [m]}]
models: {m: {price: {input_per_1m: 1.0, output_per_1m: 2.0}}}
tenants: {}
""",
    environ={},
)

pytestmark = pytest.mark.anyio


def request(
    budget: Budget, *, counted: int = 100, allowance: int | None = 50, limits: Limits | None = None
) -> Admitted:
    tenant = Tenant(
        api_keys=(hash_key("k"),), models=("m",), budget=budget, limits=limits or Limits()
    )
    return admitted(
        tenant,
        {"model": "m", "messages": []},
        tenant_name="acme",
        received_wall=NOON,
        counted=counted,
        allowance=allowance,
    )


def budgets(store: Any = None) -> tuple[Budgets, Any]:
    clock = FakeClock(start_wall=NOON)
    chosen = store or MemoryStore()
    return Budgets(chosen, PriceTable(POLICY), clock, StorageFailures()), chosen


async def test_no_quota_no_reservation() -> None:
    stage, _ = budgets()
    ctx = request(Budget(max_output_tokens=10))
    await stage(ctx)
    assert ctx.reservation is None


async def test_reserve_then_settle_to_actual_usage() -> None:
    stage, store = budgets()
    ctx = request(Budget(tokens_per_day=1000, usd_per_month=1.0))
    await stage(ctx)
    assert ctx.reservation is not None
    day, month = (q.counter for q in ctx.reservation.quotas)
    assert day.key == "tw:{acme}:q:tokens:d:20270115"
    assert month.key == "tw:{acme}:q:usd:m:202701"
    # 100 in + 50 out reserved: 150 tokens; 100 * 1 USD/M + 50 * 2 USD/M = 200 µUSD
    assert await store.read([day, month]) == [(0, 150), (0, 200_000)]
    ctx.input_tokens, ctx.output_tokens = 90, 20
    await stage.settle(ctx)
    assert await store.read([day, month]) == [(110, 0), (130_000, 0)]
    await stage.settle(ctx)  # settling twice books nothing twice
    assert await store.read([day]) == [(110, 0)]


async def test_refusal_is_insufficient_quota_with_reset_time() -> None:
    stage, _ = budgets()
    first = request(Budget(tokens_per_day=200))
    await stage(first)
    first.input_tokens, first.output_tokens = 100, 10
    await stage.settle(first)
    with pytest.raises(InsufficientQuota) as caught:
        await stage(request(Budget(tokens_per_day=200)))
    error = caught.value
    assert (error.status, error.type, error.code) == (
        429,
        "insufficient_quota",
        "insufficient_quota",
    )
    assert "tokens_per_day is 200 tokens; 110 used and 0 held" in error.message
    assert "resets at 2027-01-16 00:00 UTC" in error.message
    assert error.headers() == {
        "retry-after": str(12 * 3600),
        "retry-after-ms": str(12 * 3600 * 1000),
        "x-should-retry": "false",  # hours away: an automatic retry would only fail again
    }


async def test_a_quota_only_requests_in_flight_hold_is_retried_soon() -> None:
    """What requests in flight hold frees as they end (mostly unused): not hours away, and a
    rate limit, not `insufficient_quota` (a spent plan, which clients do not retry)."""
    stage, _ = budgets()
    await stage(request(Budget(tokens_per_day=200)))
    with pytest.raises(RateLimited) as caught:
        await stage(request(Budget(tokens_per_day=200)))
    error = caught.value
    assert (error.status, error.type, error.code) == (
        429,
        "rate_limit_error",
        "rate_limit_exceeded",
    )
    assert "tokens_per_day is 200 tokens; 0 used and 150 held" in error.message
    assert "It fits once they end" in error.message
    assert error.headers() == {"retry-after": "1", "retry-after-ms": "1000"}


async def test_unbounded_output_gets_the_default_bound() -> None:
    stage, store = budgets()
    ctx = request(Budget(tokens_per_month=100_000), allowance=None)
    await stage(ctx)
    assert ctx.body["max_tokens"] == DEFAULT_OUTPUT_BOUND
    assert ctx.outgoing.shaped == ["max_tokens"]
    assert ctx.reservation is not None
    assert await store.read([ctx.reservation.quotas[0].counter]) == [
        (0, 100 + DEFAULT_OUTPUT_BOUND)
    ]


async def test_many_concurrent_requests_never_overspend() -> None:
    stage, store = budgets()
    contexts = [request(Budget(tokens_per_day=7_500)) for _ in range(200)]
    results = await asyncio.gather(*(stage(c) for c in contexts), return_exceptions=True)
    admitted = [c for c, r in zip(contexts, results, strict=True) if r is None]
    assert len(admitted) == 50  # 50 * 150 = 7,500
    for ctx in admitted:
        ctx.input_tokens, ctx.output_tokens = 100, 50
        await stage.settle(ctx)
    assert admitted[0].reservation is None
    counter = Counter("tw:{acme}:q:tokens:d:20270115", 7_500, 0)
    assert await store.read([counter]) == [(7_500, 0)]


async def test_stop_stream_at_budget_shortens_the_answer_to_what_is_left() -> None:
    stage, store = budgets()
    await stage(request(Budget(tokens_per_day=260)))  # holds 150
    ctx = request(Budget(tokens_per_day=260, stop_stream_at_budget=True))
    await stage(ctx)
    assert ctx.body["max_tokens"] == 10  # 260 - 150 held - 100 input
    assert ctx.outgoing.shaped == ["budget"]
    assert ctx.reservation is not None
    assert await store.read([ctx.reservation.quotas[0].counter]) == [(0, 260)]
    with pytest.raises(RateLimited):  # nothing left for any output while they run
        await stage(request(Budget(tokens_per_day=260, stop_stream_at_budget=True)))


async def test_stop_stream_at_budget_shares_what_is_left_among_the_answers() -> None:
    stage, store = budgets()
    first = request(Budget(tokens_per_day=500, stop_stream_at_budget=True))
    first.outgoing.answers = 4  # n: 4, each answer allowed 50
    await stage(first)
    assert first.reservation is not None
    day = first.reservation.quotas[0].counter
    assert await store.read([day]) == [(0, 100 + 4 * 50)]
    ctx = request(Budget(tokens_per_day=500, stop_stream_at_budget=True), allowance=200)
    ctx.outgoing.answers = 4  # 100 + 4 x 200 does not fit the 200 left; 4 x 25 does
    await stage(ctx)
    assert ctx.body["max_tokens"] == 25
    assert ctx.outgoing.shaped == ["budget"]
    assert await store.read([day]) == [(0, 500)]


async def test_stop_stream_at_budget_with_a_usd_quota() -> None:
    stage, _ = budgets()
    # 100 input tokens cost 100 µUSD at 1 USD/M; 40 µUSD left buys 20 output tokens at 2 USD/M.
    ctx = request(Budget(usd_per_day=0.00014, stop_stream_at_budget=True))
    await stage(ctx)
    assert ctx.body["max_tokens"] == 20
    assert ctx.outgoing.allowance == 20


class Unreachable:
    async def reserve(self, *args: Any, **kwargs: Any) -> None:
        raise StorageError("connection refused")

    async def read(self, counters: Sequence[Counter]) -> list[tuple[int, int]]:
        raise StorageError("connection refused")


async def test_storage_failure_follows_the_tenants_policy() -> None:
    stage, _ = budgets(Unreachable())
    admitted = request(Budget(tokens_per_day=10))
    await stage(admitted)
    assert admitted.reservation is None
    with pytest.raises(StorageUnavailable):
        await stage(request(Budget(tokens_per_day=10), limits=Limits(on_storage_error="closed")))


async def test_a_long_request_keeps_its_reservation_past_its_lease_by_renewing_it() -> None:
    """The lease is renewed on the injected clock: five lease lengths on, the first request's
    reservation still counts against the quota, and only its settle frees it."""
    clock, store = FakeClock(start_wall=NOON), MemoryStore()
    stage = Budgets(store, PriceTable(POLICY), clock, StorageFailures())
    budget = Budget(tokens_per_day=200)
    first = request(budget)  # 100 input + 50 output reserved
    await stage(first)
    for _ in range(15):  # 300 s, a renewal due every 20 s
        clock.advance(20.0)
        await asyncio.sleep(0)  # the renewal the timer started runs
    with pytest.raises(RateLimited):
        await stage(request(budget))  # 150 + 150 > 200: the first still holds its 150
    first.input_tokens, first.output_tokens = 100, 50
    await stage.settle(first)
    with pytest.raises(InsufficientQuota):
        await stage(request(budget))  # 150 used + 150 > 200
    await stage(request(budget, counted=10, allowance=20))  # 150 + 30 fits


async def test_a_crashed_replicas_reservation_frees_after_the_tenants_lease_ttl() -> None:
    """A replica that dies holding a reservation neither renews nor settles it: the quota it
    held comes back after the tenant's `limits.lease_ttl`, as its concurrency slots do (it was
    60 s whatever the tenant's lease_ttl)."""
    store, budget, limits = MemoryStore(), Budget(tokens_per_day=200), Limits(lease_ttl=5.0)
    crashed = Budgets(store, PriceTable(POLICY), FakeClock(start_wall=NOON), StorageFailures())
    await crashed(request(budget, limits=limits))  # 150 held, then the replica is gone
    clock = FakeClock(start_wall=NOON)
    replica = Budgets(store, PriceTable(POLICY), clock, StorageFailures())
    with pytest.raises(RateLimited):
        await replica(request(budget, limits=limits))  # 150 + 150 > 200
    clock.advance(6.0)
    await replica(request(budget, limits=limits))  # the dead replica's 150 has expired
