"""The checkpoint sweep, on real stores: usage so far goes to the quota and the ledger as a stream
runs, only when it grew, and the final settle books the rest once."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from proxy.clock import FakeClock
from proxy.context import RequestContext
from proxy.cost import PriceTable
from proxy.keys.allowance import KeyAllowances
from proxy.keys.record import KeyAllowance, KeyRecord
from proxy.ledger import SqliteLedger, UsageQuery
from proxy.policy.model import Budget
from proxy.stages.account import Account
from proxy.stages.budget import Budgets
from proxy.stages.checkpoint import Checkpoint, CheckpointSweep
from proxy.stages.storagepolicy import StorageFailures
from proxy.storage import MemoryLimitStore, MemoryStore, QuotaStore, RedisStore
from proxy.telemetry.metrics import GatewayMetrics
from proxy.telemetry.recorder import Telemetry
from proxy.tokens import TokenCounters
from tests.redis_server import RedisProcess
from tests.reliability.cutproxy import CHARGE, CutProxy
from tests.stages.test_budget import NOON, POLICY, request

pytestmark = pytest.mark.anyio
DAY = Budget(tokens_per_day=10_000)


class Gateway:
    """The stages a checkpoint involves, as the app wires them, on memory and SQLite."""

    def __init__(
        self,
        ledger: SqliteLedger,
        sweep: CheckpointSweep | None = None,
        store: QuotaStore | None = None,
    ) -> None:
        self.clock = FakeClock(start_wall=NOON)
        self.store = store or MemoryStore()
        prices = PriceTable(POLICY)
        self.budgets = Budgets(self.store, prices, self.clock, StorageFailures())
        telemetry = Telemetry(POLICY, self.clock, GatewayMetrics())
        counters = TokenCounters(POLICY)
        self.keys = KeyAllowances(self.store, MemoryLimitStore(), self.clock, StorageFailures())
        self.account = Account(
            self.clock, [self.budgets, self.keys], prices, ledger, telemetry, counters=counters
        )
        self.sweep = sweep or CheckpointSweep()
        self.point = Checkpoint(
            self.sweep, [self.budgets, self.keys], ledger, self.account.usage_record, prices,
            counters,
        )  # fmt: skip

    async def open_stream(self, key: KeyRecord | None = None) -> RequestContext:
        ctx = request(DAY, counted=100, allowance=500)
        ctx.stream = True
        await self.budgets(ctx)
        if key is not None:
            self.keys.note(ctx, key)
            await self.keys(ctx)
        await self.point(ctx)
        ctx.outcome.status = 200
        assert ctx.reservation is not None
        self.counters = [q.counter for q in ctx.reservation.quotas]
        return ctx

    async def quota(self) -> tuple[int, int]:
        """(used, reserved) of the tenant's daily quota."""
        [pair] = await self.store.read(self.counters)
        return pair


@pytest.fixture
async def ledger(tmp_path: Path) -> SqliteLedger:
    opened = SqliteLedger(tmp_path / "ledger.db")
    await opened.start()
    return opened


def relay(ctx: RequestContext, events: int) -> None:
    ctx.meter.wrote(0.0, events, events > 0)


async def test_nothing_is_booked_before_the_first_token_and_nothing_twice(
    ledger: SqliteLedger,
) -> None:
    gateway = Gateway(ledger)
    ctx = await gateway.open_stream()
    assert gateway.sweep.watching == 1
    await gateway.sweep.sweep()
    assert await gateway.quota() == (0, 600)  # reserved 100 in + 500 out, nothing booked
    relay(ctx, 11)  # ten tokens, and maybe a finish event: ten are surely relayed
    await gateway.sweep.sweep()
    assert await gateway.quota() == (110, 490)
    first = ctx.checkpointed
    assert first is not None
    assert (first.checkpoint, first.input_tokens, first.output_tokens) == (True, 100, 10)
    await gateway.sweep.sweep()  # no new token: no new record, no booking
    assert ctx.checkpointed is first
    assert await gateway.quota() == (110, 490)
    relay(ctx, 30)
    await gateway.sweep.sweep()
    assert await gateway.quota() == (140, 460)
    assert ctx.checkpointed is not None
    assert ctx.checkpointed.supersedes is first
    await ledger.aclose()


async def test_the_final_settle_books_the_rest_and_its_record_replaces_the_checkpoints(
    ledger: SqliteLedger,
) -> None:
    gateway = Gateway(ledger)
    ctx = await gateway.open_stream()
    relay(ctx, 21)
    await gateway.sweep.sweep()
    relay(ctx, 25)
    await gateway.sweep.sweep()
    assert await gateway.quota() == (145, 455)
    ctx.outcome.answered = True
    ctx.outcome.backend_usage = (90, 46)  # the backend's own usage, smaller in, larger out
    await gateway.account(ctx)
    await gateway.sweep.sweep()  # forgets the released request
    assert gateway.sweep.watching == 0
    assert await gateway.quota() == (136, 0)
    await ledger.flush()
    [row] = await ledger.query(UsageQuery("acme", NOON - 3600, NOON + 3600))
    assert (row.requests, row.input_tokens, row.output_tokens) == (1, 90, 46)
    [final] = await ledger.latest("acme", 10)
    assert not final.checkpoint
    await ledger.aclose()


async def test_the_sweep_runs_only_while_a_stream_is_open(ledger: SqliteLedger) -> None:
    gateway = Gateway(ledger, CheckpointSweep(interval_s=0.01))
    assert gateway.sweep.task is None
    ctx = await gateway.open_stream()
    task = gateway.sweep.task
    assert task is not None
    ctx.released = True
    await asyncio.wait_for(task, 10)  # it forgets the released request, then stops
    assert gateway.sweep.task is None
    assert gateway.sweep.watching == 0
    await gateway.open_stream()
    assert gateway.sweep.task is not None  # a new stream starts it again
    await gateway.sweep.aclose()
    assert gateway.sweep.task is None
    await ledger.aclose()


async def test_a_storage_outage_fails_the_bookings_with_one_warning_and_the_sweep_goes_on(
    ledger: SqliteLedger, caplog: pytest.LogCaptureFixture
) -> None:
    redis = RedisProcess()
    redis.start()
    store = RedisStore(redis.url, timeout_s=5.0)
    try:
        gateway = Gateway(ledger, store=store)
        streams = [await gateway.open_stream() for _ in range(3)]
        for ctx in streams:
            relay(ctx, 11)
        await gateway.sweep.sweep()
        assert await gateway.quota() == (3 * 110, 3 * 490)
        redis.kill()
        with caplog.at_level(logging.DEBUG, logger="tokenweir.budget"):
            for _ in range(2):
                for ctx in streams:
                    relay(ctx, 5)
                await gateway.sweep.sweep()  # every booking fails; the sweep does not
            warned = [
                r
                for r in caplog.records
                if r.levelno == logging.WARNING and r.name.endswith("budget")
            ]
            assert [r.getMessage()[:41] for r in warned] == [
                "could not book usage so far on quota for "
            ]
            redis.start()  # an empty Redis again
            for ctx in streams:
                relay(ctx, 5)
            await gateway.sweep.sweep()
        assert caplog.records[-1].getMessage() == "booking usage so far on quotas works again"
        assert gateway.sweep.watching == 3
        assert all(ctx.checkpointed is not None for ctx in streams)
        # The ledger kept every checkpoint through the outage: 10 + 5 + 5 + 5 tokens each.
        assert [ctx.checkpointed.output_tokens for ctx in streams if ctx.checkpointed] == [25] * 3
    finally:
        await store.aclose()
        redis.close()
        await ledger.aclose()


async def test_a_runtime_keys_own_quota_is_checkpointed_and_settled_once(
    ledger: SqliteLedger,
) -> None:
    """A key made with `tokenweir keys create --budget` holds a reservation of its own: a crash
    must not lose more of its use than of the tenant's, and the end must not book it twice."""
    gateway = Gateway(ledger)
    key = KeyRecord("key_1", "acme", b"d" * 32, NOON, None, KeyAllowance(tokens_per_day=10_000))
    ctx = await gateway.open_stream(key)
    [hold] = gateway.keys._holds.values()
    [day] = hold.counters
    assert (await gateway.store.read([day]))[0] == (0, 600)
    relay(ctx, 21)
    await gateway.sweep.sweep()
    assert (await gateway.store.read([day]))[0] == (120, 480)  # booked while running
    assert await gateway.quota() == (120, 480)  # as on the tenant's
    ctx.outcome.answered = True
    ctx.outcome.backend_usage = (90, 46)
    await gateway.account(ctx)
    assert (await gateway.store.read([day]))[0] == (136, 0)  # 90 + 46, once
    assert await gateway.quota() == (136, 0)
    await ledger.aclose()


@pytest.mark.parametrize("passed_on", [False, True], ids=["never-ran", "reply-lost"])
async def test_a_lost_charge_is_booked_once_on_the_tenants_and_the_keys_quota(
    ledger: SqliteLedger, passed_on: bool
) -> None:
    """A checkpoint's charges (the tenant's and a runtime key's, in one call) lost on the way
    to Redis, or run with the reply lost: either way the gateway cannot tell. Both quotas end
    holding the request's usage exactly: the next checkpoint books what the lost one carried
    (it never ran), or not again (it did)."""
    server = RedisProcess()
    server.start()
    with CutProxy(server.port) as cut:
        store = RedisStore(f"redis://127.0.0.1:{cut.port}/0", timeout_s=5.0)
        try:
            gateway = Gateway(ledger, store=store)
            allowance = KeyAllowance(tokens_per_day=10_000)
            key = KeyRecord("key_1", "acme", b"d" * 32, NOON, None, allowance)
            ctx = await gateway.open_stream(key)
            [day] = gateway.keys._holds[ctx].counters
            relay(ctx, 21)
            cut.cut_next(CHARGE, passed_on=passed_on)
            await gateway.sweep.sweep()
            assert cut.cut
            relay(ctx, 10)
            await gateway.sweep.sweep()  # the usage so far: 100 in, 30 out
            assert (await store.read([day]))[0] == (130, 470)
            assert await gateway.quota() == (130, 470)
            ctx.outcome.answered = True
            ctx.outcome.backend_usage = (100, 40)
            await gateway.account(ctx)
            assert (await store.read([day]))[0] == (140, 0)
            assert await gateway.quota() == (140, 0)
        finally:
            await store.aclose()
            server.close()
            await ledger.aclose()
