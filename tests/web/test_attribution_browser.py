"""The tenant page's breakdowns by key, user and tag in a real headless Chromium, each checked
against the page's own /api/usage link."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.app import create_app
from proxy.clock import FakeClock
from tests.conftest import ADMIN_KEY
from tests.ledger.factory import T0, record
from tests.servers import serve
from tests.web.test_dashboard_browser import api, log_in, page  # noqa: F401 - page is a fixture
from tests.web.usage_ledger import NOW, dashboard_policy, write_ledger

from playwright.sync_api import Page  # isort: skip - after the browser module's skip


@pytest.fixture(scope="module")
def gateway(backend_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    ledger: Path = tmp_path_factory.mktemp("attribution-browser") / "ledger.db"
    made = [
        record(1, ts=T0 + 60, key_id="sha256:0a1b2c3d4e5f", user="ann", tags=("search", "beta")),
        record(2, ts=T0 + 120, key_id="sha256:0a1b2c3d4e5f", user="ann", tags=("search",)),
        record(3, ts=T0 + 180, key_id="key_00ff00ff00ff00ff", user="bob", cost_nusd=90_000),
        record(4, ts=T0 + 240, key_id="key_00ff00ff00ff00ff", user=None, tags=("faq",)),
    ]
    write_ledger(ledger, made)
    with serve(create_app(dashboard_policy(backend_url, ledger), clock=FakeClock(NOW))) as url:
        yield url


@pytest.mark.parametrize("group", ["key", "user", "tag"])
def test_breakdowns_match_the_api(page: Page, gateway: str, group: str) -> None:  # noqa: F811
    log_in(page, gateway, ADMIN_KEY)
    page.goto(gateway + "/dashboard/tenants/alpha")
    rows = api(page, f"by_{group}")
    assert rows, group
    assert page.locator(f"#by-{group} tbody tr").count() == len(rows)
    for row in rows:
        value = row[group] or ""
        shown = page.locator(f"#by-{group} tr[data-{group}='{value}']")
        assert shown.locator("th").inner_text() == (row[group] or "(none)")
        assert shown.locator("td[data-k='requests']").inner_text() == str(row["requests"])
        assert shown.locator("td[data-k='cost_usd']").inner_text() == "$" + row["cost_usd"]
    costs = [float(row["cost_usd"]) for row in rows]
    shown_costs = [
        float(cell.inner_text().lstrip("$"))
        for cell in page.locator(f"#by-{group} td[data-k='cost_usd']").all()
    ]
    assert shown_costs == sorted(costs, reverse=True)  # the costliest first
