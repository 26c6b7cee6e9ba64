"""`GET /api/usage` as a client sees it: JSON and CSV from the ledger, errors in OpenAI's shape."""

from __future__ import annotations

import argparse
import csv
import io
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from proxy.app import create_app
from proxy.clock import FakeClock
from proxy.ledger.present import iso_utc
from proxy.tools import report
from tests.conftest import ADMIN_KEY, ALPHA_KEY, make_policy
from tests.ledger.factory import DAY_S, HOUR_S, T0, record
from tests.servers import free_port, serve
from tests.web.usage_ledger import CN_KEY, CN_TENANT, NOW, records, usage_gateway

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
ALPHA = {"authorization": f"Bearer {ALPHA_KEY}"}


@pytest.fixture(scope="module")
def ledger_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("usage")


@pytest.fixture(scope="module")
def gateway(backend_url: str, ledger_dir: Path) -> Iterator[str]:
    with usage_gateway(backend_url, ledger_dir) as url:
        yield url


def usage(gateway: str, headers: dict[str, str], **params: str) -> httpx.Response:
    return httpx.get(gateway + "/api/usage", params=params, headers=headers)


def test_admin_sees_every_tenant_and_the_unauthenticated(gateway: str) -> None:
    answer = usage(gateway, ADMIN, since="1d")
    assert answer.status_code == 200
    body = answer.json()
    assert body["object"] == "usage"
    assert body["until"] == iso_utc(T0 + 3 * 3600)  # now, widened to the whole hour
    rows = {row["tenant"]: row for row in body["data"]}
    assert set(rows) == {"alpha", CN_TENANT, None}  # beta's usage is older than a day
    alpha = rows["alpha"]
    assert (alpha["requests"], alpha["errors"], alpha["rate_limited"]) == (10, 3, 2)
    assert alpha["input_tokens"] == sum(100 + i for i in range(7)) + 100
    assert alpha["cost_nusd"] == 7 * 30_000 + 10_000
    assert alpha["cost_usd"] == "0.000220"
    assert rows[CN_TENANT]["cache_hits"] == 2
    assert rows[CN_TENANT]["cache_hit_rate"] == 0.4
    assert rows[CN_TENANT]["degraded"] == 1
    assert rows[None]["errors"] == 2


def test_a_tenant_key_reads_only_its_own_tenant(gateway: str) -> None:
    rows = usage(gateway, ALPHA, since="30d").json()["data"]
    assert [row["tenant"] for row in rows] == ["alpha"]
    own = usage(gateway, ALPHA, since="30d", tenant="alpha").json()["data"]
    assert own == rows


@pytest.mark.parametrize(
    "tenant", ["beta", CN_TENANT, "ALPHA", "alpha ", "nobody", "*", "%", "alpha%00"]
)
def test_a_tenant_key_naming_another_tenant_is_refused(gateway: str, tenant: str) -> None:
    answer = usage(gateway, ALPHA, tenant=tenant)
    assert answer.status_code == 403
    error = answer.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "permission_error",
        "forbidden",
        "tenant",
    )


def test_a_repeated_tenant_parameter_is_refused(gateway: str) -> None:
    answer = httpx.get(
        gateway + "/api/usage?tenant=alpha&tenant=beta", headers=ALPHA
    )  # a parser that checks the first and reads the last would leak beta
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "tenant"


def test_buckets_and_groups_split_the_same_totals(gateway: str) -> None:
    whole = usage(gateway, ADMIN, since="1d", tenant="alpha").json()["data"][0]
    hours = usage(gateway, ADMIN, since="1d", tenant="alpha", bucket="hour").json()["data"]
    assert [row["bucket_start"] for row in hours] == [iso_utc(T0)]
    models = usage(gateway, ADMIN, since="1d", group_by="model").json()["data"]
    chinese = [row for row in models if row["tenant"] == CN_TENANT]
    assert [row["model"] for row in chinese] == ["mock-small"]
    assert hours[0]["cost_nusd"] == whole["cost_nusd"]


def test_csv_by_accept_header_or_format(gateway: str) -> None:
    by_header = usage(gateway, {**ADMIN, "accept": "text/csv"}, since="2d", bucket="day")
    by_param = usage(gateway, ADMIN, since="2d", bucket="day", format="csv")
    assert by_header.headers["content-type"] == "text/csv; charset=utf-8"
    assert by_header.text == by_param.text
    rows = list(csv.DictReader(io.StringIO(by_header.text)))
    tenants = {(row["tenant"], row["bucket_start"]) for row in rows}
    assert (CN_TENANT, "2027-01-15T00:00:00Z") in tenants
    assert ("beta", "2027-01-14T00:00:00Z") in tenants
    json_rows = usage(gateway, ADMIN, since="2d", bucket="day").json()["data"]
    assert [row["cost_usd"] for row in rows] == [row["cost_usd"] for row in json_rows]


@pytest.mark.parametrize("by", [None, "model", "backend"])
def test_the_api_agrees_with_tokenweir_report(
    gateway: str, ledger_dir: Path, by: str | None
) -> None:
    """The same ledger and window, read by `tokenweir report --format json`."""
    since = iso_utc(T0 - 2 * 86400)
    args = argparse.Namespace(
        tenant=None, since=since, until=None, by=by, format="json",
        ledger=f"sqlite:///{ledger_dir / 'ledger.db'}", config=None,
    )  # fmt: skip
    out = io.StringIO()
    assert report.main(args, clock=FakeClock(NOW), out=out) == 0
    reported = orjson.loads(out.getvalue())
    params = {"since": since} | ({"group_by": by} if by else {})
    api = usage(gateway, ADMIN, **params).json()
    assert (api["since"], api["until"]) == (
        reported["since"][:19] + "Z",
        reported["until"][:19] + "Z",
    )
    assert len(api["data"]) == len(reported["rows"]) == 4
    for ours, theirs in zip(api["data"], reported["rows"], strict=True):
        for name, value in theirs.items():
            expected = float(ours[name]) if name == "cost_usd" else ours[name]
            assert expected == value, name


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"bucket": "minute"}, "bucket"),
        ({"group_by": "tenant"}, "group_by"),
        ({"since": "yesterday"}, "since"),
        ({"since": "1d", "until": "2d"}, "since"),
        ({"since": "500d"}, "since"),
        ({"since": "90d", "bucket": "hour"}, "bucket"),
        ({"since": "9999-12-30T00:00-23:00", "until": "9999-12-31T23:00-23:00"}, "since"),
        ({"since": "0001-01-01T00:00+23:59", "until": "0001-01-02"}, "since"),
        ({"since": "1969-12-31", "until": "1970-01-02"}, "since"),
        ({"since": "1d", "until": "9999-12-31T23:00-23:00"}, "until"),
        ({"tenant_id": "beta"}, "tenant_id"),
        ({"format": "xml"}, "format"),
    ],
)
def test_bad_parameters_are_400_naming_the_parameter(
    gateway: str, params: dict[str, str], param: str
) -> None:
    answer = usage(gateway, ADMIN, **params)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == param


@pytest.mark.parametrize(
    "headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": "Basic x"}]
)
def test_no_valid_key_no_data(gateway: str, headers: dict[str, str]) -> None:
    answer = usage(gateway, headers)
    assert answer.status_code == 401
    assert answer.json()["error"]["code"] == "invalid_api_key"
    assert "data" not in answer.json()


@pytest.mark.parametrize(
    ("headers", "params"),
    [(ADMIN, {}), (ADMIN, {"format": "csv"}), (ADMIN, {"since": "<b>"}), ({}, {})],
)
def test_answers_are_not_pages(
    gateway: str, headers: dict[str, str], params: dict[str, str]
) -> None:
    """A `user` or tag is the tenant's text, and so is a parameter a link sent the operator:
    no answer may be sniffed into a page, framed or cached, errors included."""
    answer = usage(gateway, headers, **params)
    assert answer.headers["x-content-type-options"] == "nosniff"
    policy = answer.headers["content-security-policy"]
    assert "default-src 'none'" in policy
    assert "frame-ancestors 'none'" in policy
    assert answer.headers["cache-control"] == "no-store"


def test_a_gateway_without_a_ledger_says_so(gateway_url: str) -> None:
    answer = usage(gateway_url, ADMIN)
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "no_ledger"


def test_the_chinese_tenant_reads_its_own(gateway: str) -> None:
    answer = usage(gateway, {"authorization": f"Bearer {CN_KEY}"}, since="1d", format="csv")
    assert answer.text.splitlines()[1].startswith(CN_TENANT + ",")
    assert orjson.loads(usage(gateway, ADMIN, tenant=CN_TENANT).content)["tenant"] == CN_TENANT


OLD_DAY = (NOW // DAY_S - 30) * DAY_S
"""A UTC day a month before NOW: its hour totals by key, user and tag are long gone."""


@pytest.fixture(scope="module")
def old_gateway(backend_url: str, ledger_dir: Path) -> Iterator[str]:
    """alpha's key-old, used a month ago (06:00 and the next day at 12:00), and NOW's usage."""
    old = [
        record(900 + n, ts=ts, key_id="key-old", user="ann", tags=("search",), cost_nusd=1000)
        for n, ts in enumerate((OLD_DAY + 6 * HOUR_S, OLD_DAY + DAY_S + 12 * HOUR_S))
    ]
    (ledger_dir / "old").mkdir()
    with usage_gateway(backend_url, ledger_dir / "old", [*old, *records()]) as url:
        yield url


@pytest.mark.parametrize("group", ["key", "user", "tag"])
def test_an_old_window_by_key_user_or_tag_adds_up_to_its_total(
    old_gateway: str, ledger_dir: Path, group: str
) -> None:
    """Two days a month ago, from 05:00 to 13:00: by key, user or tag the API and `tokenweir
    report` answer the whole UTC days (the hours kept 8 days are gone) and count both requests,
    as the total does; the old code read the gone hours and found none. Hour buckets refuse."""
    since, until = iso_utc(OLD_DAY + 5 * HOUR_S), iso_utc(OLD_DAY + DAY_S + 13 * HOUR_S)
    api = usage(old_gateway, ADMIN, since=since, until=until, group_by=group).json()
    expected = {"key": "key-old", "user": "ann", "tag": "search"}[group]
    assert [(row[group], row["cost_nusd"]) for row in api["data"]] == [(expected, 2000)]
    assert (api["total"]["requests"], api["total"]["cost_nusd"]) == (2, 2000)
    assert (api["since"], api["until"]) == (iso_utc(OLD_DAY), iso_utc(OLD_DAY + 2 * DAY_S))
    args = argparse.Namespace(
        tenant="alpha", since=since, until=until, by=group, format="json",
        ledger=f"sqlite:///{ledger_dir / 'old' / 'ledger.db'}", config=None,
    )  # fmt: skip
    out = io.StringIO()
    assert report.main(args, clock=FakeClock(NOW), out=out) == 0
    reported = orjson.loads(out.getvalue())
    assert [(row[group], row["requests"]) for row in reported["rows"]] == [(expected, 2)]
    assert reported["total"]["requests"] == 2
    hours = usage(old_gateway, ADMIN, since=since, until=until, group_by=group, bucket="hour")
    assert hours.status_code == 400
    assert hours.json()["error"]["param"] == "bucket"
    page = httpx.get(
        old_gateway + "/dashboard/tenants/alpha", params={"since": since, "until": until},
        headers=ADMIN,
    ).text  # fmt: skip
    table = page.split(f'id="by-{group}"', 1)[1].split("</table>", 1)[0]
    assert re.search(f'data-{group}="{expected}".*?data-k="requests">2<', table, re.S)
    assert f'data-breakdown="{group}">From\n  {iso_utc(OLD_DAY)[:10]} 00:00 to' in page


def test_a_ledger_that_cannot_be_read_is_a_503_that_names_no_address(
    backend_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The Redis the ledger is on is down: a tenant's key gets a 503 on the API and the page,
    without the Redis address (it read "Error 111 connecting to 127.0.0.1:<port>"); the log
    keeps the reason."""
    port = free_port()
    policy = make_policy(backend_url, extra=f"ledger: redis://127.0.0.1:{port}/0\n")
    with serve(create_app(policy)) as url:
        answer = usage(url, ALPHA)
        page = httpx.get(url + "/dashboard/tenants/alpha", headers=ALPHA)
    assert (answer.status_code, page.status_code) == (503, 503)
    error = answer.json()["error"]
    assert (error["code"], error["message"]) == (
        "storage_unavailable",
        "The usage ledger cannot be read; try again shortly.",
    )
    assert str(port) not in page.text
    assert "The usage ledger cannot be read; try again shortly." in page.text
    logged = [r.getMessage() for r in caplog.records if r.name == "tokenweir.ledger"]
    assert any(str(port) in line for line in logged)
