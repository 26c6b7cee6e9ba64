"""`GET /api/usage`: the ledger's totals as JSON or CSV, for the tenants the caller may read.

Query: `tenant`, `since`, `until` (`7d` or ISO times, UTC), `bucket=hour|day`,
`group_by=key|user|tag|model|backend`, `format=json|csv` (or `Accept: text/csv`). Bearer key or
session cookie.
"""

from __future__ import annotations

import csv
import io
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import orjson
from starlette.datastructures import QueryParams
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from proxy.asgi.respond import send_error, send_json
from proxy.errors import BadRequest, GatewayError, NotFound, StorageUnavailable
from proxy.ledger import Bucket, GroupBy, Ledger, LedgerError, UsageQuery, UsageRow
from proxy.ledger.attribution import HOUR_RETENTION_S
from proxy.ledger.base import ATTRIBUTES
from proxy.ledger.present import format_usd, iso_utc, parse_moment, spreadsheet_cell
from proxy.ledger.query import total_of, window
from proxy.web.session import Sessions, Viewer, caller, cookie_name

if TYPE_CHECKING:
    from proxy.gateway import Gateway

__all__ = [
    "FIELDS",
    "WINDOW_PARAMS",
    "UsageApi",
    "UsageParams",
    "api_row",
    "check_names",
    "ledger_unreadable",
    "parse_params",
    "parse_window",
    "read_ledger",
]

_log = logging.getLogger("tokenweir.ledger")

MAX_WINDOW_S = 400 * 86400
MAX_HOUR_BUCKETS_S = 62 * 86400
_KNOWN = frozenset({"tenant", "since", "until", "bucket", "group_by", "format"})
WINDOW_PARAMS = frozenset({"since", "until", "bucket"})
"""What a dashboard page takes: its window (a tenant's page names its tenant in the path)."""

FIELDS = (
    "requests", "errors", "rate_limited", "degraded", "shaped", "client_disconnects",
    "input_tokens", "output_tokens", "cost_usd", "cost_nusd", "saved_cost_usd",
    "saved_cost_nusd", "cache_hits", "cache_misses", "cache_hit_rate", "ttft_ms_p50",
    "ttft_ms_p95", "tokens_per_s_p50", "counted_requests", "estimated_requests",
)  # fmt: skip
"""Each row's numbers, in CSV column order; names and meanings as in `tokenweir report`."""


@dataclass(frozen=True, slots=True)
class UsageParams:
    query: UsageQuery
    csv: bool


def parse_params(params: QueryParams, viewer: Viewer, now: float, *, accept: str) -> UsageParams:
    """Validate the query string; a tenant key may name only its own tenant (403 otherwise)."""
    check_names(params, _KNOWN)
    tenant = params.get("tenant") or None
    if tenant is not None:
        viewer.check(tenant)
    if not viewer.is_admin:
        tenant = viewer.tenant
    since, until, bucket = parse_window(params, now, default_since="7d")
    group_by = _choice(params, "group_by", ("key", "user", "tag", "model", "backend"))
    query = UsageQuery(tenant, since, until, bucket, cast(GroupBy | None, group_by), now)
    # The hour totals by key, user and tag are kept 8 days: an hour before that has none left.
    if group_by in ATTRIBUTES and bucket == "hour" and window(query)[0] < now - HOUR_RETENTION_S:
        raise BadRequest(
            f"Hour buckets by {group_by} cover at most the last 8 days; use bucket=day.",
            param="bucket",
        )
    fmt = _choice(params, "format", ("json", "csv"))
    wants_csv = fmt == "csv" or (fmt is None and "text/csv" in accept)
    return UsageParams(query, wants_csv)


def check_names(params: QueryParams, known: frozenset[str]) -> None:
    """A parameter not in `known`, or one given twice, is a 400 naming it: ignored, a misspelt
    `since` or a `tenant` where none is taken would show other figures than asked for."""
    unknown = sorted(set(params) - known)
    if unknown:
        raise BadRequest(f"Unknown query parameter {unknown[0]!r}.", param=unknown[0])
    for name in sorted(known):
        if len(params.getlist(name)) > 1:
            raise BadRequest(f"The query parameter {name!r} is given twice.", param=name)


def parse_window(
    params: QueryParams, now: float, *, default_since: str
) -> tuple[float, float, Bucket | None]:
    """`since`, `until` (default now) and `bucket`, checked: the window any usage view shows."""
    since = _moment(params.get("since") or default_since, now, "since")
    until = _moment(params["until"], now, "until") if params.get("until") else now
    if not since < until:
        raise BadRequest("since must be before until.", param="since")
    if until - since > MAX_WINDOW_S:
        raise BadRequest("A usage window may span at most 400 days.", param="since")
    bucket = _choice(params, "bucket", ("hour", "day"))
    if bucket == "hour" and until - since > MAX_HOUR_BUCKETS_S:
        raise BadRequest("Hour buckets cover at most 62 days; use bucket=day.", param="bucket")
    return since, until, cast(Bucket | None, bucket)


def ledger_of(gateway: Gateway) -> Ledger:
    """The gateway's ledger, or 404 `no_ledger` when its policy keeps none."""
    if gateway.ledger is None:
        raise NotFound(
            "This gateway keeps no usage ledger: its policy has no ledger: key.", code="no_ledger"
        )
    return gateway.ledger


async def read_ledger(ledger: Ledger, q: UsageQuery) -> list[UsageRow]:
    """The ledger's answer; a ledger that cannot be read is a 503."""
    try:
        return await ledger.query(q)
    except LedgerError as exc:
        raise ledger_unreadable(exc) from exc


def ledger_unreadable(exc: LedgerError) -> StorageUnavailable:
    """The 503 for a ledger that cannot be read. Why goes to the log, not to the caller: a
    tenant's key reads usage too, and the reason names the Redis address or the file's path."""
    _log.error("the usage ledger cannot be read: %s", exc)
    message = "The usage ledger cannot be read; try again shortly."
    return StorageUnavailable(message, retry_after_s=5)


class UsageApi:
    """`GET /api/usage`."""

    def __init__(self, sessions: Sessions) -> None:
        self._sessions = sessions

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gateway: Gateway = scope["state"]["gateway"]
        request = Request(scope)
        now = gateway.clock.wall()
        try:
            ended = gateway.services.ended_sessions
            where = caller(request, "/api/usage")
            viewer = await self._sessions.resolve(
                request.headers, request.cookies, now, ended, where, cookie=cookie_name(request)
            )
            accept = request.headers.get("accept", "")
            params = parse_params(request.query_params, viewer, now, accept=accept)
            ledger = ledger_of(gateway)
            rows = await read_ledger(ledger, params.query)
            totals = rows
            if params.query.group_by is not None and not params.csv:
                start, end = window(params.query)
                ungrouped = UsageQuery(params.query.tenant, start, end)
                totals = await read_ledger(ledger, ungrouped)
        except GatewayError as exc:
            await send_error(send, exc, _HEADERS)
            return
        if params.csv:
            await _send_csv(send, params.query, rows)
        else:
            answer = document(params.query, rows, totals)
            await send_json(send, 200, orjson.dumps(answer), _HEADERS)


# The rows carry strings a tenant wrote (its `user`, its tags): whatever a browser makes of the
# content type, it never runs them as a page of this origin, nor frames one.
_HEADERS = (
    (b"cache-control", b"no-store"),
    (b"x-content-type-options", b"nosniff"),
    (b"content-security-policy", b"default-src 'none'; frame-ancestors 'none'"),
)


def api_row(row: UsageRow) -> dict[str, object]:
    """One row's numbers under FIELDS' names (money both as exact nano-USD and as USD)."""
    hit_rate = row.cache_hit_rate
    return {
        "requests": row.requests,
        "errors": row.errors,
        "rate_limited": row.rate_limited,
        "degraded": row.degraded,
        "shaped": row.shaped,
        "client_disconnects": row.client_disconnects,
        "input_tokens": row.input_tokens,
        "output_tokens": row.output_tokens,
        "cost_usd": format_usd(row.cost_nusd),
        "cost_nusd": row.cost_nusd,
        "saved_cost_usd": format_usd(row.saved_cost_nusd),
        "saved_cost_nusd": row.saved_cost_nusd,
        "cache_hits": row.cache_hits + row.cache_semantic_hits,
        "cache_misses": row.cache_misses,
        "cache_hit_rate": None if hit_rate is None else round(hit_rate, 4),
        "ttft_ms_p50": row.ttft_ms_p50,
        "ttft_ms_p95": row.ttft_ms_p95,
        "tokens_per_s_p50": row.tokens_per_s_p50,
        "counted_requests": row.counted_requests,
        "estimated_requests": row.estimated_requests,
    }


def _labels(q: UsageQuery, row: UsageRow) -> dict[str, object]:
    labels: dict[str, object] = {"tenant": row.tenant}
    if q.bucket is not None:
        labels["bucket_start"] = iso_utc(row.bucket_start or 0)
    if q.group_by is not None:
        labels[q.group_by] = row.key
    return labels


def document(
    q: UsageQuery, rows: Sequence[UsageRow], totals: Sequence[UsageRow] | None = None
) -> dict[str, object]:
    """The JSON answer: the window actually covered (whole UTC hours), one item per row, and
    the totals over every row's tenants, each request counted once (by tag, rows overlap)."""
    start, end = window(q)
    total = api_row(total_of(list(rows if totals is None else totals)))
    for name in ("ttft_ms_p50", "ttft_ms_p95", "tokens_per_s_p50"):
        del total[name]  # percentiles do not sum
    return {
        "object": "usage",
        "since": iso_utc(start),
        "until": iso_utc(end),
        "tenant": q.tenant,
        "bucket": q.bucket,
        "group_by": q.group_by,
        "data": [_labels(q, row) | api_row(row) for row in rows],
        "total": total,
    }


async def _send_csv(send: Send, q: UsageQuery, rows: Sequence[UsageRow]) -> None:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    labels = [
        "tenant",
        *(["bucket_start"] if q.bucket else []),
        *([q.group_by] if q.group_by else []),
    ]
    writer.writerow([*labels, *FIELDS])
    for row in rows:
        values = _labels(q, row) | api_row(row)
        cells = [_label_cell(values[name]) for name in labels]
        writer.writerow([*cells, *("" if values[n] is None else values[n] for n in FIELDS)])
    body = out.getvalue().encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"text/csv; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
                (b"content-disposition", b'attachment; filename="usage.csv"'),
                *_HEADERS,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _label_cell(value: object) -> object:
    """A tenant, key, user or tag as a CSV cell: blank for none, never a formula."""
    if value is None:
        return ""
    return spreadsheet_cell(value) if isinstance(value, str) else value


def _moment(value: str, now: float, name: str) -> float:
    try:
        return parse_moment(value, now)
    except ValueError as exc:
        raise BadRequest(f"{name}: {exc}", param=name) from None


def _choice(params: QueryParams, name: str, allowed: tuple[str, ...]) -> str | None:
    value = params.get(name) or None
    if value is not None and value not in allowed:
        raise BadRequest(f"{name} must be one of {', '.join(allowed)}, got {value!r}.", param=name)
    return value
