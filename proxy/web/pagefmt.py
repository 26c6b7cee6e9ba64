"""How the dashboard writes numbers (Jinja filters) and which charts a tenant page draws."""

from __future__ import annotations

from datetime import UTC, datetime
from urllib.parse import quote

from jinja2 import Environment
from markupsafe import Markup

from proxy.ledger import UsageRow
from proxy.ledger.present import format_usd
from proxy.web.charts import Series, bar_chart, budget_bar, line_chart
from proxy.web.dashview import Quota, TenantPage

__all__ = ["UNAUTHENTICATED", "install", "tenant_charts"]

UNAUTHENTICATED = "(unauthenticated)"


def install(env: Environment) -> None:
    """Register the filters the templates use."""
    env.filters.update(
        usd=usd,
        num=num,
        pct=pct,
        ms=ms,
        rate=rate,
        tenant_url=tenant_url,
        tenant_label=tenant_label,
        quota_used=quota_used,
        bar=lambda quota: budget_bar(quota.ratio, quota.level),
        utc=utc,
    )
    env.globals["tenant_charts"] = tenant_charts


def usd(cost_nusd: int) -> str:
    """`$0.001234`: exactly the API's `cost_usd`, with a dollar sign."""
    return "$" + format_usd(cost_nusd)


def num(value: int) -> str:
    return f"{value:,}"


def pct(ratio: float | None) -> str:
    return "–" if ratio is None else f"{ratio * 100:.1f}%"


def ms(value: float | None) -> str:
    return "–" if value is None else f"{value:,.1f}"


def rate(value: float | None) -> str:
    return "–" if value is None else f"{value:,.1f}"


def tenant_url(name: str) -> str:
    return "/dashboard/tenants/" + quote(name, safe="")


def tenant_label(name: str | None) -> str:
    return UNAUTHENTICATED if name is None else name


def quota_used(quota: Quota) -> str:
    """`$1.20 / $25.00`, `$0.000213 / $0.00025` or `12,345 / 200,000 tokens`."""
    if quota.in_usd:
        return f"{_dollars(quota.used)} / {_dollars(quota.limit)}"
    return f"{quota.used:,} / {quota.limit:,} tokens"


def _dollars(cost_nusd: int) -> str:
    """To the micro-USD as the spend beside it (`usd`), without its trailing zeros past the
    cents: cents alone hid a small spend ($0.00) and misstated a limit under a cent."""
    whole, fraction = format_usd(cost_nusd).split(".")
    return f"${int(whole):,}.{fraction.rstrip('0').ljust(2, '0')}"


def utc(ts: float | None, bucket: str = "minute") -> str:
    moment = datetime.fromtimestamp(ts or 0, UTC)
    if bucket == "day":
        return moment.strftime("%Y-%m-%d")
    return moment.strftime("%Y-%m-%d %H:%M")


def tenant_charts(page: TenantPage) -> dict[str, Markup]:
    """Cost, requests, tokens, TTFT and speed per bucket, as inline SVG."""
    rows = page.series
    hourly = page.window.bucket == "hour"
    labels = [_bucket_label(row, hourly) for row in rows]

    def series(name: str, css: str, values: list[float | None]) -> Series:
        return Series(name, values, css)

    return {
        "cost": bar_chart(labels, [r.cost_nusd / 1e9 for r in rows], _money, "Cost (USD)"),
        "requests": line_chart(
            labels,
            [
                series("requests", "a", [float(r.requests) for r in rows]),
                series("errors", "b", [float(r.errors) for r in rows]),
                series("429s", "c", [float(r.rate_limited) for r in rows]),
            ],
            _count,
            "Requests, errors and 429s",
        ),
        "tokens": line_chart(
            labels,
            [
                series("input", "a", [float(r.input_tokens) for r in rows]),
                series("output", "b", [float(r.output_tokens) for r in rows]),
            ],
            _count,
            "Tokens",
        ),
        "ttft": line_chart(
            labels,
            [
                series("TTFT p50", "a", [r.ttft_ms_p50 for r in rows]),
                series("TTFT p95", "c", [r.ttft_ms_p95 for r in rows]),
            ],
            _millis,
            "Time to first token (ms)",
        ),
        "speed": line_chart(
            labels,
            [series("tokens/s p50", "a", [r.tokens_per_s_p50 for r in rows])],
            _count,
            "Median output tokens/s per request",
        ),
    }


def _bucket_label(row: UsageRow, hourly: bool) -> str:
    moment = datetime.fromtimestamp(row.bucket_start or 0, UTC)
    return moment.strftime("%H:00" if hourly else "%m-%d")


def _money(value: float) -> str:
    return f"${value:,.4f}" if value < 1 else f"${value:,.2f}"


def _count(value: float) -> str:
    if value >= 10_000:
        return f"{value / 1000:,.0f}k"
    return f"{value:,.0f}"


def _millis(value: float) -> str:
    return f"{value:,.0f}"
