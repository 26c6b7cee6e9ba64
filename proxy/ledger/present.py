"""How people name ledger windows and read its money: `7d` or ISO times, UTC periods, USD."""

from __future__ import annotations

from datetime import UTC, datetime

from proxy.policy.units import parse_duration_s

__all__ = [
    "day_start",
    "format_usd",
    "iso_utc",
    "month_start",
    "parse_moment",
    "spreadsheet_cell",
]

_EARLIEST = 0.0
_LATEST = datetime(9000, 1, 1, tzinfo=UTC).timestamp()
"""A moment outside [1970, 9000) is refused: the window around it, widened to whole hours or
days and written back in ISO, would reach past what a datetime can hold (years 1 to 9999)."""


def parse_moment(value: str, now: float) -> float:
    """`7d` (that long before `now`) or an ISO date or time, UTC unless it names an offset."""
    try:
        ago = parse_duration_s(value)
    except ValueError:
        pass
    else:
        return _within_range(now - ago, value)
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(
            f"expected a duration like 7d or a date like 2025-01-31, got {value!r}"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return _within_range(moment.timestamp(), value)


def _within_range(ts: float, value: str) -> float:
    if not _EARLIEST <= ts < _LATEST:
        raise ValueError(f"expected a moment from 1970-01-01 to 9000-01-01 UTC, got {value!r}")
    return ts


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


_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def spreadsheet_cell(text: str) -> str:
    """A name for a CSV cell: one a spreadsheet would run as a formula (`=HYPERLINK(...)` as a
    client's `user` or tag) gets a leading `'`, which shows it as the text it is (OWASP's rule)."""
    return "'" + text if text.startswith(_FORMULA_STARTS) else text
