"""Checkpoints of running streams: about once a second, each open stream's usage so far is booked
on its quotas and recorded in the ledger, so a crash of the gateway loses at most about a second
of relayed tokens per request. Writes checkpointed (the final record supersedes it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Protocol

from proxy.context import Admitted
from proxy.cost import PriceTable
from proxy.ledger import Ledger, UsageRecord
from proxy.stages.usage import relayed_output
from proxy.together import cancelled, together
from proxy.tokens import TokenCounters

__all__ = ["CHECKPOINT_INTERVAL_S", "Checkpoint", "CheckpointSweep"]

CHECKPOINT_INTERVAL_S = 1.0


class Booker(Protocol):
    """A holder of a running request's quota reservation (the tenant's budgets, a runtime key's
    own allowance) that can book its usage so far."""

    def holding(self, ctx: Admitted) -> bool: ...

    def charge_so_far(
        self, ctx: Admitted, input_tokens: int, output_tokens: int
    ) -> Awaitable[None] | None: ...


class CheckpointSweep:
    """One task for every open stream of the process, running only while some are open: a
    stream costs a dict entry, and a store call per checkpoint that found new tokens."""

    def __init__(self, interval_s: float = CHECKPOINT_INTERVAL_S) -> None:
        self._interval_s = interval_s
        self._open: dict[Admitted, Checkpoint] = {}
        self._task: asyncio.Task[None] | None = None

    @property
    def watching(self) -> int:
        return len(self._open)

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The sweeping task while any stream is watched; None when there is none."""
        return self._task

    def watch(self, ctx: Admitted, point: Checkpoint) -> None:
        """Checkpoint `ctx` with `point` (its gateway's) until it is released."""
        self._open[ctx] = point
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="tokenweir-checkpoints")

    async def sweep(self) -> None:
        """Checkpoint every open stream once; forget those released since the last sweep.

        Each stream's ledger record and quota note are taken without awaiting, so a request that
        settles meanwhile finds them in place; only the quota bookings are awaited, together."""
        bookings: list[Awaitable[None]] = []
        for ctx, point in list(self._open.items()):
            if ctx.released:
                del self._open[ctx]
                continue
            bookings += point.take(ctx)
        await together(bookings)

    async def aclose(self) -> None:
        task, self._task = self._task, None
        await cancelled([task])
        self._open.clear()

    async def _run(self) -> None:
        try:
            while self._open:
                await asyncio.sleep(self._interval_s)
                await self.sweep()
        finally:
            if self._task is asyncio.current_task():
                self._task = None


class Checkpoint:
    """The stage that puts a stream in the sweep (the last before the upstream call), and the
    maker of its checkpoints under this gateway's policy."""

    def __init__(
        self,
        sweep: CheckpointSweep,
        bookers: Sequence[Booker],
        ledger: Ledger | None,
        record: Callable[[Admitted], UsageRecord],
        prices: PriceTable,
        counters: TokenCounters,
    ) -> None:
        self._sweep = sweep
        self._bookers = bookers
        self._ledger = ledger
        self._record = record
        self._prices = prices
        self._counters = counters

    async def __call__(self, ctx: Admitted) -> None:
        if ctx.stream and (self._ledger is not None or any(b.holding(ctx) for b in self._bookers)):
            self._sweep.watch(ctx, self)

    def take(self, ctx: Admitted) -> list[Awaitable[None]]:
        """Record `ctx`'s usage so far in the ledger, if it grew, and return its quota bookings
        (none when there is nothing new to book). Nothing before the stream's first token."""
        if ctx.outcome.answered or ctx.released:
            return []  # its final settle is under way
        output = relayed_output(ctx)
        if output == 0:
            return []
        input_tokens = ctx.counted_input_tokens or 0
        last = ctx.checkpointed
        grew = last is None or (last.input_tokens, last.output_tokens) != (input_tokens, output)
        if self._ledger is not None and grew:
            ctx.checkpointed = self._point(ctx, input_tokens, output)
            self._ledger.append(ctx.checkpointed)
        bookings = (b.charge_so_far(ctx, input_tokens, output) for b in self._bookers)
        return [booking for booking in bookings if booking is not None]

    def _point(self, ctx: Admitted, input_tokens: int, output_tokens: int) -> UsageRecord:
        """The request's record as it stands, with the usage so far. No TTFT or speed sample:
        the final record brings those (and superseding takes back only plain counters)."""
        exact = self._counters.for_model(ctx.model).exact
        return replace(
            self._record(ctx),
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            cost_nusd=self._prices.cost_nusd(ctx.model, input_tokens, output_tokens),
            usage_source="counted" if exact else "estimated",
            ttft_ms=None,
            tokens_per_s=None,
            checkpoint=True,
        )
