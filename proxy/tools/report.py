"""`tokenweir report`: per-tenant usage and cost from the ledger, as a table, CSV or JSON.

The ledger is the one named by `--ledger`, else by the policy file's `ledger:` key.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

import orjson

from proxy.app import DEFAULT_POLICY
from proxy.clock import Clock, SystemClock
from proxy.exitstatus import USAGE
from proxy.ledger import LedgerError, UsageQuery, UsageRow, open_ledger
from proxy.ledger.base import ATTRIBUTES
from proxy.ledger.present import format_usd, parse_moment, spreadsheet_cell
from proxy.ledger.query import total_of, window
from proxy.policy import PolicyError, load_policy
from proxy.storage.redis.url import shown_url
from proxy.tools import runloop
from proxy.tools.textout import stdout_for, text_width

__all__ = ["ReportError", "add_arguments", "format_usd", "main", "parse_time", "text_width"]

UNAUTHENTICATED = "(unauthenticated)"


class ReportError(Exception):
    """A report that cannot be produced; the message is for the person who asked for it."""


class WindowError(ReportError):
    """--since or --until that names no usable window: a usage error (exit status 2)."""


@dataclass(frozen=True, slots=True)
class Report:
    ledger: str
    since: float
    until: float
    by: str | None
    rows: list[UsageRow]
    totals: list[UsageRow]
    """Per tenant, not grouped: what the total line sums (by tag, rows overlap)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `report` flags to its subparser."""
    when = "a duration ago (7d, 12h) or a UTC date or time (2025-01-31, 2025-01-31T08:00)"
    parser.add_argument("--tenant", help="only this tenant (default: every tenant)")
    parser.add_argument("--since", default="7d", help=f"start: {when} (default: 7d)")
    parser.add_argument("--until", help=f"end: {when} (default: now)")
    parser.add_argument(
        "--by",
        choices=["key", "user", "tag", "model", "backend"],
        help="also split by API key id, the requests' user field, tag, model or backend",
    )
    parser.add_argument("--format", choices=["table", "csv", "json"], default="table")
    parser.add_argument(
        "--ledger", help="ledger URL, e.g. sqlite:///tokenweir.db (default: the policy's)"
    )
    parser.add_argument(
        "--config", type=Path, help="policy file naming the ledger (default: the embedded default)"
    )


def main(args: argparse.Namespace, *, clock: Clock | None = None, out: TextIO | None = None) -> int:
    stream = out or stdout_for(data=args.format != "table")
    now = (clock or SystemClock()).wall()
    try:
        since = parse_time(args.since, now, flag="--since")
        until = now if args.until is None else parse_time(args.until, now, flag="--until")
        if since >= until:
            raise WindowError(
                f"--since ({_minute(since)} UTC) must be before --until ({_minute(until)} UTC)"
            )
        url, storage = _ledger_location(args.ledger, args.config)
        query = UsageQuery(args.tenant, since, until, group_by=args.by, now=now)
        rows, totals = runloop.run(_fetch(url, storage, query))
    except ReportError as exc:
        print(f"tokenweir report: {exc}", file=sys.stderr)
        return USAGE if isinstance(exc, WindowError) else 1
    start, end = window(query)
    report = Report(url, start, end, args.by, rows, totals)
    {"table": write_table, "csv": write_csv, "json": write_json}[args.format](report, stream)
    return 0


def parse_time(value: str, now: float, *, flag: str) -> float:
    """`7d` (that long before `now`) or an ISO date or time, UTC unless it names an offset."""
    try:
        return parse_moment(value, now)
    except ValueError as exc:
        raise WindowError(f"{flag}: {exc}") from None


def _ledger_location(ledger: str | None, config: Path | None) -> tuple[str, str | None]:
    """The ledger URL and the policy's storage URL (which `ledger: redis` refers to)."""
    if ledger is not None and ledger != "redis":
        return ledger, None
    path = config or DEFAULT_POLICY
    try:
        policy = load_policy(path, keys_needed=False)  # a report serves nobody
    except PolicyError as exc:
        raise ReportError(
            f"cannot read the ledger setting from the policy {path}:\n{exc}\n"
            "(pass --ledger URL to read a ledger without a policy)"
        ) from None
    if ledger is None and policy.ledger is None:
        raise ReportError(
            f"the policy {path} has no ledger: key, so no usage is recorded; "
            "add one (e.g. ledger: sqlite:///tokenweir.db) or pass --ledger URL"
        )
    return ledger or policy.ledger or "", policy.storage


async def _fetch(
    url: str, storage: str | None, query: UsageQuery
) -> tuple[list[UsageRow], list[UsageRow]]:
    """The rows asked for, and each tenant's totals over the same window."""
    try:
        ledger = open_ledger(url, storage_url=storage, read_only=True)
    except ValueError as exc:
        raise ReportError(str(exc)) from None
    try:
        await ledger.start()
        rows = await ledger.query(query)
        if query.group_by is None:
            return rows, rows
        start, end = window(query)  # the grouped answer's window, which may be wider
        return rows, await ledger.query(UsageQuery(query.tenant, start, end))
    except LedgerError as exc:
        raise ReportError(str(exc)) from None
    finally:
        await ledger.aclose()


_MACHINE_FIELDS = (
    "requests",
    "errors",
    "rate_limited",
    "degraded",
    "input_tokens",
    "output_tokens",
    "cost_usd",
    "cost_nusd",
    "cache_hits",
    "cache_hit_rate",
    "ttft_ms_p50",
    "ttft_ms_p95",
    "tokens_per_s_p50",
    "counted_requests",
    "estimated_requests",
)


def _machine_row(row: UsageRow) -> dict[str, object]:
    hit_rate = row.cache_hit_rate
    values: dict[str, object] = {
        "requests": row.requests,
        "errors": row.errors,
        "rate_limited": row.rate_limited,
        "degraded": row.degraded,
        "input_tokens": row.input_tokens,
        "output_tokens": row.output_tokens,
        "cost_usd": format_usd(row.cost_nusd),
        "cost_nusd": row.cost_nusd,
        "cache_hits": row.cache_hits + row.cache_semantic_hits,
        "cache_hit_rate": None if hit_rate is None else round(hit_rate, 4),
        "ttft_ms_p50": row.ttft_ms_p50,
        "ttft_ms_p95": row.ttft_ms_p95,
        "tokens_per_s_p50": row.tokens_per_s_p50,
        "counted_requests": row.counted_requests,
        "estimated_requests": row.estimated_requests,
    }
    return values


def write_json(report: Report, out: TextIO) -> None:
    rows = []
    for row in report.rows:
        item: dict[str, object] = {"tenant": row.tenant}
        if report.by:
            item[report.by] = row.key
        item |= _machine_row(row)
        item["cost_usd"] = float(str(item["cost_usd"]))
        rows.append(item)
    total = _machine_row(_summed(report.totals))
    total["cost_usd"] = float(str(total["cost_usd"]))
    for name in ("ttft_ms_p50", "ttft_ms_p95", "tokens_per_s_p50"):
        del total[name]  # percentiles do not sum
    document = {
        "ledger": shown_url(report.ledger),
        "since": datetime.fromtimestamp(report.since, UTC).isoformat(),
        "until": datetime.fromtimestamp(report.until, UTC).isoformat(),
        "rows": rows,
        "total": total,
    }
    out.write(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode() + "\n")


def write_csv(report: Report, out: TextIO) -> None:
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["tenant", *([report.by] if report.by else []), *_MACHINE_FIELDS])
    for row in report.rows:
        values = _machine_row(row)
        key = [spreadsheet_cell(row.key or "")] if report.by else []
        cells = ["" if values[f] is None else values[f] for f in _MACHINE_FIELDS]
        writer.writerow([spreadsheet_cell(row.tenant or ""), *key, *cells])


_TABLE_HEADER = ("requests", "errors", "input tokens", "output tokens", "cost (USD)", "cache hits")


def write_table(report: Report, out: TextIO) -> None:
    span = f"{_minute(report.since)} to {_minute(report.until)} UTC"
    out.write(f"Usage {span}, ledger {shown_url(report.ledger)}\n")
    if not report.rows:
        out.write("No usage recorded in this window.\n")
        return
    header = ("tenant", *([report.by] if report.by else []), *_TABLE_HEADER)
    lines = [_table_line(row, report.by) for row in report.rows]
    if len(report.rows) > 1:
        lines.append(_total_line(report.totals, report.by is not None))
    left = 2 if report.by else 1  # text columns; the rest are numbers, right-aligned
    out.write("\n".join(_aligned([header, *lines], left)) + "\n")
    if report.by == "tag":
        out.write("A request with several tags counts under each; the total counts it once.\n")
    estimated = sum(row.estimated_requests for row in report.totals)
    if estimated:
        out.write(
            f"{estimated:,} requests were billed on an estimate (their model has no tokenizer "
            "and the backend reported no usage).\n"
        )


def _table_line(row: UsageRow, by: str | None) -> tuple[str, ...]:
    blank = "(none)" if by in ATTRIBUTES else "-"
    label = (row.tenant or UNAUTHENTICATED, *([row.key or blank] if by else []))
    return (*label, *_numbers(row))


def _numbers(row: UsageRow) -> tuple[str, ...]:
    hits = row.cache_hits + row.cache_semantic_hits
    counts = (row.requests, row.errors, row.input_tokens, row.output_tokens)
    return (*(f"{n:,}" for n in counts), format_usd(row.cost_nusd), f"{hits:,}")


def _total_line(totals: Sequence[UsageRow], grouped: bool) -> tuple[str, ...]:
    return ("total", *([""] if grouped else []), *_numbers(_summed(totals)))


def _summed(totals: Sequence[UsageRow]) -> UsageRow:
    return total_of(list(totals))


def _aligned(lines: Sequence[tuple[str, ...]], left_columns: int) -> list[str]:
    widths = [max(text_width(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = []
    for line in lines:
        cells = []
        for i, cell in enumerate(line):
            pad = " " * (widths[i] - text_width(cell))
            cells.append(cell + pad if i < left_columns else pad + cell)
        out.append("  ".join(cells).rstrip())
    return out


def _minute(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M")
