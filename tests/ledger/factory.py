"""Usage records for ledger tests: sensible defaults, any field overridden by keyword."""

from __future__ import annotations

from dataclasses import replace

from proxy.ledger import UsageRecord

T0 = 1_800_000_000.0
"""2027-01-15 08:00:00 UTC: a whole hour, not a whole day."""

HOUR_S = 3600.0
DAY_S = 86400.0

_BASE = UsageRecord(
    ts=T0,
    request_id="req-0",
    tenant="alpha",
    model="mock-llm",
    backend="mock-a",
    operation="chat",
    stream=True,
    status=200,
    error=None,
    input_tokens=100,
    output_tokens=50,
    cost_nusd=30_000,
    cache="miss",
    ttft_ms=120.0,
    tokens_per_s=80.0,
    duration_ms=750.0,
    shaped=(),
    degraded=(),
    client_disconnected=False,
)


def record(n: int = 0, **fields: object) -> UsageRecord:
    """Record number `n`: request id `req-<n>`, arriving `n` milliseconds after T0."""
    defaults: dict[str, object] = {"ts": T0 + n / 1000, "request_id": f"req-{n}"}
    return replace(_BASE, **(defaults | fields))  # type: ignore[arg-type]
