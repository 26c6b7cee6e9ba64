"""The batches a Redis ledger writer's Redis took lately, per tenant: sent again when a failover
shows that the primary which took them has lost them (lua/append.lua answers `gap`)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from proxy.ledger.base import UsageRecord

__all__ = ["TakenBatch", "TakenBatches"]


@dataclass(frozen=True, slots=True)
class TakenBatch:
    """One tenant's share of batch `seq`, and the seq of that tenant's batch taken before it."""

    seq: int
    records: list[UsageRecord]
    previous: int | None


class TakenBatches:
    """Kept for `keep_s` (a graceful Sentinel failover sends writes to the old primary for about
    2 s; a partitioned primary takes them until the sentinels promote its replica) and at most
    `max_records` in all, oldest dropped first."""

    def __init__(
        self,
        *,
        keep_s: float = 30.0,
        max_records: int = 20_000,  # ~520 bytes each: 10 MB, 6 s at 3,000 a second
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._keep_s = keep_s
        self._max_records = max_records
        self._monotonic = monotonic
        self._last: dict[str, int] = {}
        self._by_tenant: dict[str, deque[TakenBatch]] = {}
        self._order: deque[tuple[float, str]] = deque()
        self._records = 0

    def last(self, tenant_tag: str) -> int | None:
        """The seq of the tenant's last batch Redis took, while any of its batches is kept."""
        return self._last.get(tenant_tag)

    def took(self, tenant_tag: str, seq: int, records: list[UsageRecord]) -> None:
        batch = TakenBatch(seq, records, self._last.get(tenant_tag))
        self._last[tenant_tag] = seq
        self._by_tenant.setdefault(tenant_tag, deque()).append(batch)
        now = self._monotonic()
        self._order.append((now, tenant_tag))
        self._records += len(records)
        while self._order and (
            self._order[0][0] < now - self._keep_s or self._records > self._max_records
        ):
            _, oldest = self._order.popleft()
            kept = self._by_tenant[oldest]
            self._records -= len(kept.popleft().records)
            if not kept:  # nothing to send again: no gap to look for either (a marker
                del self._by_tenant[oldest]  # expires a day after its last batch)
                del self._last[oldest]

    def after(self, tenant_tag: str, applied: int) -> tuple[list[TakenBatch], bool]:
        """After Redis said it lacks the tenant's batches after `applied`: those kept, in order,
        and whether they are all it lacks (none was dropped from here before)."""
        kept = [b for b in self._by_tenant.get(tenant_tag, ()) if b.seq > applied]
        if not kept:
            return [], False
        first = kept[0].previous
        return kept, first is None or first <= applied
