"""The account's settle gives back everything a request holds, even when one stage's settle
fails: real budgets on the memory store, beside a stage whose settle raises before its storage
call (two audit findings leaked a request's slot and reservation that way)."""

from __future__ import annotations

from collections.abc import Awaitable

import pytest

from proxy.clock import FakeClock
from proxy.context import Admitted
from proxy.cost import PriceTable
from proxy.policy.model import Budget
from proxy.stages.account import Account
from proxy.stages.budget import Budgets
from proxy.stages.storagepolicy import StorageFailures
from proxy.storage import MemoryStore
from proxy.telemetry.metrics import GatewayMetrics
from proxy.telemetry.recorder import Telemetry
from tests.stages.test_budget import NOON, POLICY, request

pytestmark = pytest.mark.anyio


class _Failing:
    """A stage holding something whose settle raises at once, as a stage's bug would."""

    def holding(self, ctx: Admitted) -> bool:
        return True

    def settle(self, ctx: Admitted) -> Awaitable[None]:
        raise RuntimeError("this stage could not settle")


async def test_a_stage_whose_settle_raises_leaves_the_others_to_give_back() -> None:
    clock, store, prices = FakeClock(start_wall=NOON), MemoryStore(), PriceTable(POLICY)
    budgets = Budgets(store, prices, clock, StorageFailures())
    telemetry = Telemetry(POLICY, clock, GatewayMetrics())
    # The failing stage gives back first, as the last stage a request passes does.
    account = Account(clock, [_Failing(), budgets], prices, None, telemetry)
    ctx = request(Budget(tokens_per_day=10_000), counted=100, allowance=500)
    await budgets(ctx)
    assert ctx.reservation is not None
    counters = [quota.counter for quota in ctx.reservation.quotas]
    assert await store.read(counters) == [(0, 600)]
    ctx.outcome.status = 200
    with pytest.raises(RuntimeError, match="could not settle"):
        await account.release(ctx)
    used, reserved = (await store.read(counters))[0]
    assert reserved == 0  # the reservation was given back; the request's use booked
    assert used > 0


async def test_a_bill_that_raises_leaves_what_the_request_holds_given_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bill that cannot be worked out (an audit found one: a tool input nested past what
    orjson writes) gave back nothing: the reservation, and a slot, stayed held until their
    leases ended. Now they are given back, the error raised after."""

    def broken(ctx: object, counter: object) -> None:
        raise RuntimeError("the bill could not be worked out")

    monkeypatch.setattr("proxy.stages.account.bill", broken)
    clock, store, prices = FakeClock(start_wall=NOON), MemoryStore(), PriceTable(POLICY)
    budgets = Budgets(store, prices, clock, StorageFailures())
    account = Account(clock, [budgets], prices, None, Telemetry(POLICY, clock, GatewayMetrics()))
    ctx = request(Budget(tokens_per_day=10_000), counted=100, allowance=500)
    await budgets(ctx)
    assert ctx.reservation is not None
    counters = [quota.counter for quota in ctx.reservation.quotas]
    ctx.outcome.status = 200
    with pytest.raises(RuntimeError, match="could not be worked out"):
        await account.release(ctx)
    assert (await store.read(counters))[0][1] == 0  # nothing held any more
