"""The dashboard pages and their access rules, as a browser without script would see them."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from html import escape as html_escape
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

import httpx
import pytest

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from tests.conftest import ADMIN_KEY, ALPHA_KEY, BETA_KEY, policy_text
from tests.servers import serve
from tests.web.usage_ledger import CN_KEY, CN_TENANT, usage_gateway

COOKIE = "tokenweir_session"


@pytest.fixture(scope="module")
def gateway(backend_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with usage_gateway(backend_url, tmp_path_factory.mktemp("dashboard")) as url:
        yield url


@contextmanager
def logged_in(gateway: str, key: str) -> Iterator[httpx.Client]:
    """A client holding the session cookie that logging in with `key` set."""
    with httpx.Client(base_url=gateway) as client:
        answer = client.post("/dashboard/login", data={"key": key, "next": "/dashboard"})
        assert answer.status_code == 303, answer.text
        yield client


def cell(html: str, tenant: str, field: str) -> str:
    row = re.search(rf'<tr data-tenant="{re.escape(tenant)}">(.*?)</tr>', html, re.S)
    assert row is not None, tenant
    found = re.search(rf'data-k="{field}">([^<]*)<', row.group(1))
    assert found is not None, field
    return found.group(1)


def test_the_login_cookie_is_signed_httponly_strict_and_holds_no_key(gateway: str) -> None:
    with httpx.Client(base_url=gateway) as client:
        answer = client.post("/dashboard/login", data={"key": ADMIN_KEY})
    assert answer.status_code == 303
    assert answer.headers["location"] == "/dashboard"
    header = answer.headers["set-cookie"]
    assert "HttpOnly" in header
    assert "SameSite=strict" in header
    assert "Secure" not in header  # plain http here; https answers add it
    assert ADMIN_KEY not in header


def test_the_cookie_is_secure_behind_https(gateway: str) -> None:
    answer = httpx.post(
        gateway + "/dashboard/login",
        data={"key": ADMIN_KEY},
        headers={"x-forwarded-proto": "https"},  # uvicorn trusts it from 127.0.0.1
    )
    assert "Secure" in answer.headers["set-cookie"]


def _set(answer: httpx.Response) -> tuple[str, str]:
    """The name and value the answer's Set-Cookie sets."""
    name, _, value = answer.headers["set-cookie"].split(";")[0].partition("=")
    return name, value


def test_over_https_no_other_host_can_plant_a_session(gateway: str) -> None:
    """Over https the cookie is `__Host-` prefixed: browsers take such a cookie only from this
    very host, Secure, with Path=/. A plain-named one (which a sibling subdomain, or an http
    page of the host, may set: a valid session of the attacker's tenant, so the victim reads
    and acts as that tenant) is not read over https. Before, any cookie of the name was."""
    https = {"x-forwarded-proto": "https"}  # trusted from 127.0.0.1
    answer = httpx.post(gateway + "/dashboard/login", data={"key": ALPHA_KEY}, headers=https)
    name, own = _set(answer)
    assert name == "__Host-" + COOKIE
    assert "Secure" in answer.headers["set-cookie"]
    assert "Path=/" in answer.headers["set-cookie"]
    assert "domain" not in answer.headers["set-cookie"].lower()
    page = httpx.get(gateway + "/dashboard", headers={**https, "cookie": f"{name}={own}"})
    assert page.status_code == 200
    _, planted = _set(httpx.post(gateway + "/dashboard/login", data={"key": BETA_KEY}))
    tossed = httpx.get(gateway + "/dashboard", headers={**https, "cookie": f"{COOKIE}={planted}"})
    assert tossed.status_code == 303  # to the login form, not beta's dashboard
    usage = httpx.get(gateway + "/api/usage", headers={**https, "cookie": f"{COOKIE}={planted}"})
    assert usage.status_code == 401
    out = httpx.post(gateway + "/dashboard/logout", headers={**https, "cookie": f"{name}={own}"})
    assert out.headers["set-cookie"].startswith(f'{name}="";')  # a browser drops it
    assert "Secure" in out.headers["set-cookie"]


def test_a_wrong_key_is_refused_at_login(gateway: str) -> None:
    answer = httpx.post(gateway + "/dashboard/login", data={"key": "guess"})
    assert answer.status_code == 401
    assert "set-cookie" not in answer.headers
    assert "not known" in answer.text


def test_admin_overview_lists_every_tenant_with_budget_colours(gateway: str) -> None:
    with logged_in(gateway, ADMIN_KEY) as client:
        html = client.get("/dashboard").text
    assert CN_TENANT in html
    assert f'href="/dashboard/tenants/{quote(CN_TENANT, safe="")}"' in html
    assert cell(html, "alpha", "requests") == "10"
    assert cell(html, "alpha", "cost_usd") == "$0.000220"
    assert cell(html, CN_TENANT, "cache_hit_rate") == "40.0%"
    assert cell(html, "", "errors") == "2"  # the unauthenticated row
    assert 'data-quota="usd_per_day" data-level="over"' in html  # the Chinese tenant: 125%
    assert 'data-quota="usd_per_month" data-level="warn"' in html  # alpha: 88%


def test_a_tenant_sees_only_itself_on_the_overview(gateway: str) -> None:
    with logged_in(gateway, ALPHA_KEY) as client:
        html = client.get("/dashboard").text
    assert 'data-tenant="alpha"' in html
    for other in (CN_TENANT, "beta", 'data-tenant=""', "data-total"):
        assert other not in html


def test_tenant_page_shows_models_errors_and_buckets(gateway: str) -> None:
    with logged_in(gateway, ALPHA_KEY) as client:
        html = client.get("/dashboard/tenants/alpha", params={"since": "1d"}).text
    assert 'data-model="mock-llm"' in html
    assert "rate_limit_exceeded</th><td>2<" in html
    assert "upstream_timeout</th><td>1<" in html
    assert html.count('<svg class="chart"') == 5
    assert "<script" not in html


@pytest.mark.parametrize(
    "path",
    [
        "/dashboard/tenants/beta",
        f"/dashboard/tenants/{quote(CN_TENANT)}",
        "/dashboard/tenants/ALPHA",
        "/dashboard/tenants/alpha%20",
        "/dashboard/tenants/alpha/../beta",
        "/dashboard/tenants/beta?tenant=alpha",
        "/dashboard/tenants/nobody",
        "/dashboard/tenants/%2e%2e%2fbeta",
    ],
)
def test_a_tenant_cannot_open_another_tenants_page(gateway: str, path: str) -> None:
    with logged_in(gateway, ALPHA_KEY) as client:
        answer = client.get(path)
    assert answer.status_code in (403, 404)
    assert "beta" not in answer.text.replace(path, "") or answer.status_code == 404
    assert 'data-k="cost_usd"' not in answer.text


def test_a_bearer_key_works_on_pages_too(gateway: str) -> None:
    page = f"/dashboard/tenants/{quote(CN_TENANT)}"
    own = httpx.get(gateway + page, headers={"authorization": f"Bearer {CN_KEY}"})
    assert own.status_code == 200
    other = httpx.get(gateway + page, headers={"authorization": f"Bearer {BETA_KEY}"})
    assert other.status_code == 403


@pytest.mark.parametrize("cookie", ["", "x", "a.b", "AAAA.AAAA"])
def test_no_or_forged_cookie_goes_to_the_login_form(gateway: str, cookie: str) -> None:
    answer = httpx.get(gateway + "/dashboard/tenants/alpha", cookies={COOKIE: cookie})
    assert answer.status_code == 303
    assert answer.headers["location"].startswith("/dashboard/login?next=/dashboard/tenants/alpha")


def test_a_tampered_cookie_is_worthless(gateway: str) -> None:
    with logged_in(gateway, ALPHA_KEY) as client:
        value = client.cookies[COOKIE]
    body, mac = value.split(".")
    flip = {"A": "B"}
    for forged in (
        body[:5] + flip.get(body[5], "A") + body[6:] + "." + mac,
        body + "." + mac[:5] + flip.get(mac[5], "A") + mac[6:],
        body + "." + mac[:-1] + flip.get(mac[-1], "A"),  # same bytes, another spelling
    ):
        answer = httpx.get(gateway + "/api/usage", cookies={COOKIE: forged})
        assert answer.status_code == 401


def test_logout_ends_the_session_in_the_browser(gateway: str) -> None:
    with logged_in(gateway, ALPHA_KEY) as client:
        answer = client.post("/dashboard/logout")
        assert answer.status_code == 303
        assert client.get("/dashboard").status_code == 303


@pytest.mark.parametrize("sender", ["cross-site", "same-site"])
def test_a_form_posted_from_another_site_is_refused(gateway: str, sender: str) -> None:
    """Login CSRF: another site's page posting its own key would log the victim's browser in
    as the attacker's tenant (or end the victim's session)."""
    headers = {"sec-fetch-site": sender, "origin": "https://evil.example"}
    with httpx.Client(base_url=gateway) as client:
        login = client.post("/dashboard/login", data={"key": ALPHA_KEY}, headers=headers)
        assert login.status_code == 403
        assert "set-cookie" not in login.headers
        assert client.post("/dashboard/login", data={"key": ALPHA_KEY}).status_code == 303
        logout = client.post("/dashboard/logout", headers=headers)
        assert logout.status_code == 403
        assert client.get("/dashboard").status_code == 200  # still logged in
    own = {"sec-fetch-site": "same-origin"}
    assert (
        httpx.post(gateway + "/dashboard/login", data={"key": ALPHA_KEY}, headers=own).status_code
        == 303
    )


@pytest.mark.parametrize(
    ("origin", "refused"),
    [("https://evil.example", True), ("null", True), ("own", False), (None, False)],
)
def test_a_browser_without_fetch_metadata_is_judged_by_its_origin(
    gateway: str, origin: str | None, refused: bool
) -> None:
    """Browsers that send no Sec-Fetch-Site (Safari before 16.4) still send Origin with a
    form's POST: another site's (or a sandboxed page's "null") is refused; the gateway's own,
    or none at all (curl), is not."""
    headers = {} if origin is None else {"origin": gateway if origin == "own" else origin}
    login = httpx.post(gateway + "/dashboard/login", data={"key": ALPHA_KEY}, headers=headers)
    assert login.status_code == (403 if refused else 303)
    assert ("set-cookie" in login.headers) is not refused


def test_login_never_redirects_off_the_dashboard(gateway: str) -> None:
    for target in ("https://evil.example/", "//evil.example", "/v1/models", "/dashboard\\@x"):
        answer = httpx.post(gateway + "/dashboard/login", data={"key": ALPHA_KEY, "next": target})
        assert answer.headers["location"] == "/dashboard"


@pytest.mark.parametrize("path", ["/dashboard", "/dashboard/tenants/alpha"])
@pytest.mark.parametrize(
    "window",
    [
        {"since": "9999-12-30T00:00-23:00", "until": "9999-12-31T23:00-23:00"},
        {"since": "0001-01-01T00:00+23:59", "until": "0001-01-02"},
    ],
)
def test_a_window_past_the_calendar_is_a_400_page(
    gateway: str, path: str, window: dict[str, str]
) -> None:
    headers = {"authorization": f"Bearer {ADMIN_KEY}"}
    answer = httpx.get(gateway + path, params=window, headers=headers)
    assert answer.status_code == 400
    assert "1970-01-01 to 9000-01-01" in answer.text


def test_pages_forbid_framing_and_foreign_content(gateway: str) -> None:
    answer = httpx.get(gateway + "/dashboard/login")
    policy = answer.headers["content-security-policy"]
    assert "default-src 'none'" in policy
    assert "frame-ancestors 'none'" in policy
    assert answer.headers["cache-control"] == "no-store"
    css = httpx.get(gateway + "/dashboard/static/dashboard.css")
    assert css.headers["content-type"].startswith("text/css")


def test_without_a_ledger_the_page_says_so(gateway_url: str, tmp_path: Path) -> None:
    answer = httpx.get(gateway_url + "/dashboard", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert answer.status_code == 404
    assert "no usage ledger" in answer.text


def test_a_usd_quota_shows_its_spend_and_limit_as_exactly_as_the_spend_beside_it(
    gateway: str,
) -> None:
    """A USD quota was shown in whole cents: alpha's month, $0.000220 spent of its 0.00025,
    read "$0.00 / $0.00 (88.0%)", beside a spend column of $0.000220, and a limit under a cent
    read as 0 or as a cent. Now to the micro-USD, as the spend column and /api/usage show it."""
    with logged_in(gateway, ADMIN_KEY) as client:
        html = client.get("/dashboard").text
    row = re.search(r'<tr data-tenant="alpha">(.*?)</tr>', html, re.S)
    assert row is not None
    quota = re.search(r'data-quota="usd_per_month".*?class="qused">([^<]*)<', row.group(1), re.S)
    assert quota is not None
    assert cell(html, "alpha", "month_cost_usd") == "$0.000220"
    assert quota.group(1) == "$0.00022 / $0.00025 (88.0%)"
    daily = re.search(r'data-quota="usd_per_day".*?class="qused">([^<]*)<', row.group(1), re.S)
    assert daily is not None
    assert daily.group(1).endswith(" / $1.00 (0.0%)")


def test_a_tenant_page_links_back_to_its_own_tenant_whatever_its_name(
    backend_url: str, tmp_path: Path
) -> None:
    """Links were built from the decoded path: a tenant named with a `%` and two hex digits
    (`sale 50%25/eu`) was linked, from its window presets and the login's way back, as another
    tenant (`sale 50%/eu`), shown empty to an admin."""
    name, key = "sale 50%25/eu", "tw-test-sale"
    text = policy_text(backend_url, extra=f"ledger: sqlite:///{tmp_path / 'ledger.db'}\n")
    text = text.replace(
        "tenants:\n",
        f'tenants:\n  "{name}":\n    api_keys: [{hash_key(key)}]\n    models: [mock-small]\n',
    )
    policy = parse_policy(text, file="t.yaml", environ={"BACKEND_KEY": "k", "BETA_KEY": "b"})
    page = "/dashboard/tenants/" + quote(name, safe="")
    with serve(create_app(policy)) as url, httpx.Client(base_url=url) as client:
        html = client.get(page, headers={"authorization": f"Bearer {key}"}).text
        preset = re.search(r'href="([^"]*)\?since=24h"', html)
        assert preset is not None
        assert preset.group(1) == page
        to_login = client.get(page + "?since=7d")
        assert to_login.status_code == 303
        (back,) = parse_qs(urlsplit(to_login.headers["location"]).query)["next"]
        logged_in = client.post("/dashboard/login", data={"key": key, "next": back})
        assert logged_in.headers["location"] == page + "?since=7d"
        shown = client.get(logged_in.headers["location"]).text
        assert f'data-tenant-page="{html_escape(name)}"' in shown


@pytest.mark.parametrize("path", ["/dashboard", "/dashboard/tenants/alpha"])
@pytest.mark.parametrize(
    ("query", "param"),
    [("sinse=30d", "sinse"), ("tenant=beta", "tenant"), ("since=30d&since=1d", "since")],
)
def test_a_page_refuses_a_query_parameter_it_does_not_take_as_the_api_does(
    gateway: str, path: str, query: str, param: str
) -> None:
    """/api/usage refuses a parameter it does not know or one given twice (400 naming it); the
    pages showed their default window instead (a misspelt `since`, or `tenant` on the overview,
    showed another window's or every tenant's money with nothing saying so)."""
    headers = {"authorization": f"Bearer {ADMIN_KEY}"}
    api = httpx.get(f"{gateway}/api/usage?{query}", headers=headers)
    page = httpx.get(f"{gateway}{path}?{query}", headers=headers)
    if param != "tenant":  # /api/usage takes a tenant
        assert api.status_code == 400
        assert api.json()["error"]["param"] == param
    assert page.status_code == 400
    assert re.search(rf"query parameter .{{1,6}}{param}", page.text)
    fine = httpx.get(f"{gateway}{path}?since=30d&bucket=day", headers=headers)
    assert fine.status_code == 200
