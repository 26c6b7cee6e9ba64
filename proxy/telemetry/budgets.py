"""What is left of every tenant's quotas, read from storage when `/metrics` is scraped.

One storage read per tenant with quotas per scrape (every 15 s or so), nothing on the request
path: the quotas are the ones the budget stage reserves against, counted the same way.
"""

from __future__ import annotations

import asyncio

from proxy.policy import Policy
from proxy.stages.budget import _quotas
from proxy.storage import QuotaStore, StorageError
from proxy.telemetry.metrics import BudgetLeft

__all__ = ["budgets_left"]

_NUSD_PER_USD = 1e9


async def budgets_left(
    policy: Policy, store: QuotaStore, now: float, timeout_s: float = 2.0
) -> list[BudgetLeft]:
    """Every quota of every tenant; a storage that fails or is slow gives none (logged nowhere:
    /readyz reports storage trouble)."""
    left: list[BudgetLeft] = []
    try:
        async with asyncio.timeout(timeout_s):
            for tenant, spec in policy.tenants.items():
                quotas = _quotas(tenant, spec.budget, now)
                if not quotas:
                    continue
                readings = await store.read([q.counter for q in quotas])
                for quota, (used, reserved) in zip(quotas, readings, strict=True):
                    remaining = max(0, quota.counter.limit - used - reserved)
                    value = remaining / _NUSD_PER_USD if quota.in_usd else float(remaining)
                    left.append(BudgetLeft(tenant, quota.name, value))
    except (StorageError, TimeoutError):
        return []
    return left
