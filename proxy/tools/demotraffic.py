"""A simulated day of gateway traffic for the demo's ledger, so its dashboard has a story to show.

Records are made, not sent: three tenants with office-hours peaks, their own models and prompt
sizes, a few refusals (429s, a model not allowed, an over-long prompt) and backend failures.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

from proxy.cost import PriceTable
from proxy.ledger import SqliteLedger, UsageRecord
from proxy.policy.model import Policy
from proxy.tools import runloop

__all__ = ["TENANT_PROFILES", "fill_ledger", "simulated_day"]

HOUR_S = 3600


@dataclass(frozen=True, slots=True)
class _Profile:
    """How one tenant uses the gateway in a day."""

    requests: int
    models: tuple[tuple[str, float], ...]  # model, share of requests
    input_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    errors: tuple[tuple[int, str, float], ...]  # status, error code, share of requests
    shaped: float  # share of requests whose max_tokens the budget clamped
    cache_hits: float | None = None  # with the response cache on: share of answers it served


TENANT_PROFILES: dict[str, _Profile] = {
    "support-bot": _Profile(
        600, (("mock-llm-small", 0.85), ("mock-embed", 0.15)), (120, 420), (20, 64),
        ((403, "model_not_allowed", 0.005), (502, "upstream_error", 0.004)), 0.4,
    ),
    "research": _Profile(
        450, (("mock-llm", 0.8), ("mock-llm-small", 0.2)), (800, 6000), (150, 900),
        ((429, "rate_limit_exceeded", 0.04), (504, "upstream_timeout", 0.006)), 0.0, 0.3,
    ),
    "翻译助手": _Profile(
        1700, (("mock-llm", 1.0),), (900, 2100), (500, 1300),
        ((400, "context_length_exceeded", 0.01), (502, "upstream_error", 0.005)), 0.0,
    ),
}  # fmt: skip
_TTFT_MS = {"mock-llm": 320.0, "mock-llm-small": 140.0}
_TOKENS_PER_S = {"mock-llm": 62.0, "mock-llm-small": 125.0}


def _load(hour: int) -> float:
    """Relative traffic in a UTC hour: a quiet night, a working-day hump peaking mid-afternoon."""
    return 0.15 + max(0.0, math.sin(math.pi * (hour - 6) / 14))


def simulated_day(policy: Policy, end: float, *, seed: int = 7) -> list[UsageRecord]:
    """The 24 hours before `end`, for the tenants of `policy` that have a profile; time order."""
    rng = random.Random(seed)  # noqa: S311 - simulated traffic, not secrets
    prices = PriceTable(policy)
    hours = [int(end - (24 - i) * HOUR_S) for i in range(24)]
    weights = [_load(h // HOUR_S % 24) for h in hours]
    records: list[UsageRecord] = []
    for tenant, profile in TENANT_PROFILES.items():
        if tenant not in policy.tenants:
            continue
        for n, hour in enumerate(rng.choices(hours, weights, k=profile.requests)):
            ts = hour + rng.uniform(0, HOUR_S)
            busy = _load(int(ts) // HOUR_S % 24)
            records.append(_record(rng, prices, tenant, profile, ts, busy, f"{tenant}-{n}"))
    for n in range(12):  # scanners and misconfigured clients without a valid key
        records.append(_refused(end - rng.uniform(0, 24 * HOUR_S), f"anon-{n}"))
    records.sort(key=lambda record: record.ts)
    return records


def _record(
    rng: random.Random,
    prices: PriceTable,
    tenant: str,
    profile: _Profile,
    ts: float,
    busy: float,
    request_id: str,
) -> UsageRecord:
    model = rng.choices([m for m, _ in profile.models], [w for _, w in profile.models])[0]
    status, error = 200, None
    roll = rng.random()
    for code, kind, share in profile.errors:
        if roll < share * (0.5 + busy):  # trouble grows with load
            status, error = code, kind
            break
        roll -= share * (0.5 + busy)
    embed = model == "mock-embed"
    served = status == 200 or status >= 500
    input_tokens = rng.randint(*profile.input_tokens) if served else 0
    output_tokens = rng.randint(*profile.output_tokens) if status == 200 and not embed else 0
    ttft = tokens_per_s = None
    if status == 200 and not embed:
        ttft = rng.lognormvariate(math.log(_TTFT_MS[model] * (0.8 + 0.6 * busy)), 0.35)
        tokens_per_s = max(5.0, rng.gauss(_TOKENS_PER_S[model] / (0.9 + 0.3 * busy), 8.0))
    duration_ms = (ttft or 20.0) + (output_tokens / tokens_per_s * 1000 if tokens_per_s else 0.0)
    record = UsageRecord(
        ts=ts, request_id=request_id, tenant=tenant, model=model, backend="mock",
        operation="embeddings" if embed else "chat", stream=not embed and rng.random() < 0.7,
        status=status, error=error, input_tokens=input_tokens, output_tokens=output_tokens,
        cost_nusd=prices.cost_nusd(model, input_tokens, output_tokens), cache="bypass",
        ttft_ms=ttft, tokens_per_s=tokens_per_s, duration_ms=duration_ms,
        shaped=("max_tokens",) if rng.random() < profile.shaped else (), degraded=(),
        client_disconnected=status == 200 and rng.random() < 0.01,
    )  # fmt: skip
    if profile.cache_hits is None or embed or status != 200:
        return record
    if rng.random() >= profile.cache_hits:
        return replace(record, cache="miss")
    return replace(  # answered from the cache: no backend tokens, in about a millisecond
        record, cache="hit", input_tokens=0, output_tokens=0, cost_nusd=0,
        ttft_ms=rng.uniform(0.6, 1.4), tokens_per_s=None, duration_ms=rng.uniform(0.8, 2.0),
        saved_input_tokens=input_tokens, saved_output_tokens=output_tokens,
        saved_cost_nusd=record.cost_nusd,
    )  # fmt: skip


def _refused(ts: float, request_id: str) -> UsageRecord:
    return UsageRecord(
        ts=ts, request_id=request_id, tenant=None, model=None, backend=None, operation="chat",
        stream=False, status=401, error="invalid_api_key", input_tokens=0, output_tokens=0,
        cost_nusd=0, cache="bypass", ttft_ms=None, tokens_per_s=None, duration_ms=0.3,
        shaped=(), degraded=(), client_disconnected=False,
    )  # fmt: skip


def fill_ledger(path: Path, records: list[UsageRecord]) -> None:
    """Write `records` into the SQLite ledger at `path` (created if new) and wait until durable."""

    async def write() -> None:
        ledger = SqliteLedger(path, buffer_records=len(records) + 1)
        await ledger.start()
        try:
            for record in records:
                ledger.append(record)
        finally:
            await ledger.aclose()

    runloop.run(write())
