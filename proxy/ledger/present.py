"""How people name ledger windows and read its money: `7d` or ISO times, UTC periods, USD."""

from __future__ import annotations

from datetime import UTC, datetime

from proxy.policy.units import parse_duration_s

__all__ = ["day_start", "format_usd", "iso_utc", "month_start", "parse_moment"]


def parse_moment(value: str, now: float) -> float:
    """`7d` (that long before `now`) or an ISO date or time, UTC unless it names an offset."""
    try:
        return now - parse_duration_s(value)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(
            f"expected a duration like 7d or a date like 2025-01-31, got {value!r}"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def day_start(ts: float) -> float:
    """The start of `ts`'s UTC day."""
    return float(int(ts // 86400) * 86400)


def month_start(ts: float) -> float:
    """The start of `ts`'s UTC calendar month: budgets' `usd_per_month` period."""
    moment = datetime.fromtimestamp(ts, UTC)
    return datetime(moment.year, moment.month, 1, tzinfo=UTC).timestamp()


def iso_utc(ts: float) -> str:
    """`2027-01-15T08:00:00Z`: whole seconds, UTC."""
    return datetime.fromtimestamp(int(ts), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def format_usd(cost_nusd: int) -> str:
    """Nano-USD as dollars with 6 decimals, rounded half up, computed exactly in integers."""
    micro = (cost_nusd + 500) // 1000
    return f"{micro // 1_000_000}.{micro % 1_000_000:06d}"
