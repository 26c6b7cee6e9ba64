"""The dashboard in a real headless Chromium: log in, read the pages, compare with /api/usage.

Uses Debian's `chromium` (/usr/bin/chromium) through Playwright; nothing is downloaded. With
TOKENWEIR_SCREENSHOTS=1 the screenshots go to docs/screenshots/ (README's), else to tmp_path.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urljoin

import pytest

from proxy.app import DEFAULT_POLICY, create_app
from proxy.clock import FakeClock
from proxy.ledger.present import iso_utc
from proxy.policy import load_policy
from proxy.tools.demo import DEMO_ADMIN_KEY, DEMO_KEYS
from proxy.tools.demotraffic import simulated_day
from tests.servers import serve
from tests.web.usage_ledger import NOW, write_ledger

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip(
        "no browser: install Debian's chromium package (apt-get install chromium)",
        allow_module_level=True,
    )
from playwright.sync_api import Page, sync_playwright  # noqa: E402 - only with a browser

SHOTS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"
TRANSLATE = "翻译助手"


@pytest.fixture(scope="module")
def demo_gateway(backend_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The demo policy over a ledger holding the demo's simulated day; the clock at NOW."""
    ledger = tmp_path_factory.mktemp("browser") / "ledger.db"
    policy = load_policy(DEFAULT_POLICY.with_name("demo.yaml"), environ={})
    backends = tuple(b.model_copy(update={"url": backend_url + "/v1"}) for b in policy.backends)
    policy = policy.model_copy(update={"backends": backends, "ledger": f"sqlite:///{ledger}"})
    write_ledger(ledger, simulated_day(policy, NOW - NOW % 3600))
    with serve(create_app(policy, clock=FakeClock(NOW))) as url:
        yield url


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Page]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            yield browser.new_page(viewport={"width": 1920, "height": 1000})
        finally:
            browser.close()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    if os.environ.get("TOKENWEIR_SCREENSHOTS"):
        SHOTS.mkdir(parents=True, exist_ok=True)
        return SHOTS
    return tmp_path


def log_in(page: Page, base: str, key: str) -> None:
    page.goto(base + "/dashboard")
    assert "/dashboard/login" in page.url  # no key, no data
    page.fill("#key", key)
    page.click("form[action='/dashboard/login'] button[type=submit]")
    page.wait_for_url(base + "/dashboard")


def shown(page: Page, row_selector: str) -> dict[str, float | None]:
    """A row's numbers as the page shows them ($, commas and % taken off; – is no value)."""
    found: dict[str, float | None] = {}
    for cell in page.locator(f"{row_selector} td[data-k]").all():
        text = cell.inner_text().strip().replace("$", "").replace(",", "").replace("%", "")
        found[str(cell.get_attribute("data-k"))] = None if text == "–" else float(text)
    return found


def expected(row: dict[str, Any]) -> dict[str, float | None]:
    """The API's numbers written the way the page writes them."""

    def round1(value: float | None) -> float | None:
        return None if value is None else round(value, 1)

    rate = row["cache_hit_rate"]
    return {
        "requests": row["requests"], "input_tokens": row["input_tokens"],
        "output_tokens": row["output_tokens"], "cost_usd": float(row["cost_usd"]),
        "cache_hit_rate": None if rate is None else round(rate * 100, 1),
        "saved_cost_usd": float(row["saved_cost_usd"]), "errors": row["errors"],
        "rate_limited": row["rate_limited"], "degraded": row["degraded"],
        "ttft_ms_p50": round1(row["ttft_ms_p50"]), "ttft_ms_p95": round1(row["ttft_ms_p95"]),
        "tokens_per_s_p50": round1(row["tokens_per_s_p50"]),
    }  # fmt: skip


def api(page: Page, link: str) -> list[dict[str, Any]]:
    """Follow the page's own link to /api/usage (same window), with the session cookie."""
    href = page.locator(f"a[data-api='{link}']").first.get_attribute("href")
    assert href is not None
    assert href.startswith("/api/usage?")
    answer = page.request.get(urljoin(page.url, href))
    assert answer.ok
    data: list[dict[str, Any]] = answer.json()["data"]
    return data


def test_admin_overview_and_tenant_page_match_the_api(
    page: Page, demo_gateway: str, shots: Path
) -> None:
    log_in(page, demo_gateway, DEMO_ADMIN_KEY)
    page.screenshot(path=str(shots / "dashboard-overview.png"), full_page=True)
    rows = api(page, "json")
    assert {row["tenant"] for row in rows} == {*DEMO_KEYS, None}
    today = page.request.get(demo_gateway + f"/api/usage?since={iso_utc(NOW - NOW % 86400)}")
    spent_today = {row["tenant"]: float(row["cost_usd"]) for row in today.json()["data"]}
    for row in rows:
        numbers = shown(page, f"#overview tbody tr[data-tenant='{row['tenant'] or ''}']")
        assert numbers.pop("today_cost_usd") == spent_today.get(row["tenant"], 0.0)
        assert numbers.pop("month_cost_usd") is not None
        assert numbers == expected(row), row["tenant"]
    assert page.locator(f"#overview a:text-is('{TRANSLATE}')").count() == 1

    page.click(f"#overview a:text-is('{TRANSLATE}')")
    page.wait_for_url(f"**/dashboard/tenants/{quote(TRANSLATE, safe='')}")
    assert page.locator("h1").inner_text() == TRANSLATE
    assert page.locator("svg.chart").count() == 5
    page.screenshot(path=str(shots / "dashboard-tenant.png"), full_page=True)
    (total,) = api(page, "json")
    numbers = shown(page, "#totals tbody tr")
    assert numbers.pop("today_cost_usd") == spent_today[TRANSLATE]
    assert numbers.pop("month_cost_usd") is not None
    assert numbers == expected(total)
    series = api(page, "series")
    page.click("details summary")
    buckets = page.locator("#series tr[data-bucket]").all()
    by_start = {row["bucket_start"]: row for row in series}
    assert len(buckets) >= len(series)
    for bucket in buckets:
        stamp = int(str(bucket.get_attribute("data-bucket")))
        label = iso_utc(stamp)
        if label in by_start:
            assert shown(page, f"#series tr[data-bucket='{stamp}']") == expected(by_start[label])
        else:
            assert shown(page, f"#series tr[data-bucket='{stamp}']")["requests"] == 0
    models = {row["model"]: row for row in api(page, "by_model")}
    for model, row in models.items():
        cost = page.locator(f"#by-model tr[data-model='{model}'] td[data-k='cost_usd']")
        assert cost.inner_text() == "$" + row["cost_usd"]


def test_a_tenant_in_the_browser_sees_only_itself(page: Page, demo_gateway: str) -> None:
    log_in(page, demo_gateway, DEMO_KEYS["support-bot"])
    assert page.locator("#overview tbody tr").count() == 1
    assert [row["tenant"] for row in api(page, "json")] == ["support-bot"]
    answer = page.goto(demo_gateway + f"/dashboard/tenants/{quote(TRANSLATE, safe='')}")
    assert answer is not None
    assert answer.status == 403
    assert page.locator("td[data-k]").count() == 0
    refused = page.request.get(demo_gateway + "/api/usage?tenant=research")
    assert refused.status == 403
