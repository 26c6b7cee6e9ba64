"""A tenant writes markup and script into what the operator's dashboard shows (its `user`, its
tags, a URL it sends the operator); in a real headless Chromium, all of it is text, no script runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import openai
import pytest

from proxy.app import create_app
from proxy.policy import parse_policy
from tests.conftest import ADMIN_KEY, ALPHA_KEY, BACKEND_KEY, BETA_KEY, policy_text
from tests.servers import serve
from tests.web.test_dashboard_browser import log_in, page  # noqa: F401 - page is a fixture

from playwright.sync_api import Page  # isort: skip - after the browser module's skip

USERS = (
    '"><img src=x onerror=alert(1)>',
    "</script><script>alert(2)</script>",
    "<!--<svg onload=alert(3)>",
    "'><svg/onload=alert(4)>",
    "</title><script>alert(5)</script>",
    "javascript:alert(6)",
)
TAGS = "javascript:alert,=HYPERLINK"


@pytest.fixture(scope="module")
def gateway(backend_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    ledger: Path = tmp_path_factory.mktemp("hostile") / "ledger.db"
    text = policy_text(backend_url, extra=f"ledger: sqlite:///{ledger}\n")
    environ = {"BACKEND_KEY": BACKEND_KEY, "BETA_KEY": BETA_KEY}
    with serve(create_app(parse_policy(text, file="hostile.yaml", environ=environ))) as url:
        with openai.OpenAI(base_url=url + "/v1", api_key=ALPHA_KEY, max_retries=0) as sdk:
            for user in USERS:
                sdk.chat.completions.create(
                    model="mock-llm",
                    messages=[{"role": "user", "content": "hi"}],
                    user=user,
                    extra_headers={"x-tokenweir-tags": TAGS},
                )
        _wait_for(url, requests=len(USERS))
        yield url


def _wait_for(url: str, *, requests: int) -> None:
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = httpx.get(url + "/api/usage", headers=admin).json()["data"]
        if sum(row["requests"] for row in rows) >= requests:
            return
        time.sleep(0.1)
    raise AssertionError(f"the ledger did not show {requests} requests within 10 s")


def test_tenant_text_is_shown_as_text_and_runs_nothing(
    page: Page,  # noqa: F811
    gateway: str,
) -> None:
    ran: list[str] = []
    page.on("dialog", lambda dialog: (ran.append(dialog.message), dialog.dismiss()))
    log_in(page, gateway, ADMIN_KEY)
    page.goto(gateway + "/dashboard/tenants/alpha")
    shown = {cell.inner_text() for cell in page.locator("#by-user tbody th").all()}
    assert shown == set(USERS)
    tags = {cell.inner_text() for cell in page.locator("#by-tag tbody th").all()}
    assert tags == set(TAGS.split(","))
    # Links a tenant could send the operator: a page for a "tenant" that is markup, a bad
    # window echoed in a 400 page, a login whose next page is markup.
    for path in (
        "/dashboard/tenants/" + quote(USERS[0], safe=""),
        "/dashboard/tenants/alpha?since=" + quote(USERS[1], safe=""),
        "/dashboard/login?next=/dashboard/" + quote(USERS[3], safe=""),
    ):
        page.goto(gateway + path)
        assert page.locator("script, img, svg[onload]").count() == 0, path
    assert ran == []
