"""Spend by key, user and tag, end to end: the openai SDK through a real gateway (SQLite or Redis
ledger), then `tokenweir report --by`, `/api/usage?group_by=` and the tenant's dashboard page."""

from __future__ import annotations

import argparse
import hashlib
import io
import re
import time
from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest
import redis

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.tools import report
from tests.conftest import ADMIN_KEY, ALPHA_KEY, BACKEND_KEY, BETA_KEY, policy_text
from tests.servers import serve

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
HI = [{"role": "user", "content": "hi"}]
ALPHA_ID = "sha256:" + hashlib.sha256(ALPHA_KEY.encode()).hexdigest()[:12]


@pytest.fixture(scope="module", params=["sqlite", "redis"])
def ledger_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path_factory.mktemp('attribution') / 'ledger.db'}"
    # The session's private Redis, emptied first: the report reads all of it.
    url: str = request.getfixturevalue("redis_server")
    with redis.Redis.from_url(url) as client:
        client.flushdb()
    return url


@pytest.fixture(scope="module")
def gateway(backend_url: str, ledger_url: str) -> Iterator[tuple[str, str]]:
    storage = ledger_url if ledger_url.startswith("redis") else "memory"
    text = policy_text(backend_url, extra=f"ledger: {ledger_url}\n")
    text = text.replace("storage: memory", f"storage: {storage}")
    environ = {"BACKEND_KEY": BACKEND_KEY, "BETA_KEY": BETA_KEY}
    app = create_app(parse_policy(text, file="attribution.yaml", environ=environ))
    with serve(app) as url:
        runtime = httpx.post(url + "/admin/keys", json={"tenant": "alpha"}, headers=ADMIN)
        assert runtime.status_code == 201, runtime.text
        created = runtime.json()
        _traffic(url, created["key"])
        yield url, created["id"]


def _traffic(url: str, runtime_key: str) -> None:
    """alpha: 3 requests on its policy key (ann twice, tagged), 1 on a runtime key, 1 refused."""
    with openai.OpenAI(base_url=url + "/v1", api_key=ALPHA_KEY, max_retries=0) as sdk:
        tags = {"x-tokenweir-tags": "search, beta"}
        sdk.chat.completions.create(model="mock-llm", messages=HI, user="ann", extra_headers=tags)
        sdk.chat.completions.create(
            model="mock-llm", messages=HI, user="ann", metadata={"feature": "search"}
        )
        stream = sdk.chat.completions.create(
            model="mock-llm", messages=HI, user="bob", stream=True, metadata={"feature": "faq"}
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.chat.completions.create(
                model="mock-llm", messages=HI, extra_headers={"x-tokenweir-tags": "has space"}
            )
        assert refused.value.status_code == 400
        assert refused.value.body["param"] == "x-tokenweir-tags"  # type: ignore[index]
        assert refused.value.body["code"] == "invalid_tags"  # type: ignore[index]
    with openai.OpenAI(base_url=url + "/v1", api_key=runtime_key, max_retries=0) as sdk:
        sdk.embeddings.create(model="mock-embed", input="hello", user="carol")
    _wait_for(url, requests=5)


def _wait_for(url: str, *, requests: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        answer = httpx.get(url + "/api/usage", params={"tenant": "alpha"}, headers=ADMIN)
        rows = answer.json()["data"]
        if rows and rows[0]["requests"] >= requests:
            return
        time.sleep(0.1)
    raise AssertionError(f"the ledger did not show {requests} requests within 10 s")


def usage(url: str, group_by: str) -> dict[str, object]:
    answer = httpx.get(
        url + "/api/usage", params={"tenant": "alpha", "group_by": group_by}, headers=ADMIN
    )
    assert answer.status_code == 200, answer.text
    document: dict[str, object] = answer.json()
    return document


def requests_by(document: dict[str, object], group_by: str) -> dict[str | None, int]:
    rows = document["data"]
    assert isinstance(rows, list)
    return {row[group_by]: row["requests"] for row in rows}


def test_usage_api_groups_by_key(gateway: tuple[str, str]) -> None:
    url, runtime_id = gateway
    document = usage(url, "key")
    assert requests_by(document, "key") == {ALPHA_ID: 4, runtime_id: 1}
    assert ALPHA_KEY not in orjson.dumps(document).decode()  # an id, never the secret


def test_usage_api_groups_by_user(gateway: tuple[str, str]) -> None:
    url, _ = gateway
    assert requests_by(usage(url, "user"), "user") == {"ann": 2, "bob": 1, "carol": 1, None: 1}


def test_usage_api_groups_by_tag_and_totals_count_each_request_once(
    gateway: tuple[str, str],
) -> None:
    url, _ = gateway
    document = usage(url, "tag")
    # The refused request's tag was never recorded; it is "untagged" and billed nothing.
    assert requests_by(document, "tag") == {"search": 2, "beta": 1, "faq": 1, None: 2}
    total = document["total"]
    assert isinstance(total, dict)
    assert total["requests"] == 5
    assert total["errors"] == 1
    rows = document["data"]
    assert isinstance(rows, list)
    refused = next(row for row in rows if row["tag"] is None)
    assert refused["errors"] == 1


def test_hour_buckets_by_tag_cover_at_most_eight_days(gateway: tuple[str, str]) -> None:
    url, _ = gateway
    params = {"group_by": "tag", "bucket": "hour", "since": "9d"}
    answer = httpx.get(url + "/api/usage", params=params, headers=ADMIN)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "bucket"


def run_report(ledger_url: str, *flags: str) -> str:
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    out = io.StringIO()
    assert report.main(parser.parse_args(["--ledger", ledger_url, *flags]), out=out) == 0
    return out.getvalue()


def test_report_by_tag_table_totals_once(gateway: tuple[str, str], ledger_url: str) -> None:
    text = run_report(ledger_url, "--by", "tag", "--tenant", "alpha")
    lines = {line.split()[1]: line.split() for line in text.splitlines()[1:-1] if " " in line}
    assert lines["search"][2] == "2"
    assert lines["(none)"][2] == "2"
    total = next(line for line in text.splitlines() if line.startswith("total"))
    assert total.split()[1] == "5"  # 2 + 1 + 1 + 2 rows, 5 requests
    assert "counts under each" in text


def test_report_by_key_and_user_as_json(gateway: tuple[str, str], ledger_url: str) -> None:
    _, runtime_id = gateway
    by_key = orjson.loads(run_report(ledger_url, "--by", "key", "--format", "json"))
    assert {row["key"]: row["requests"] for row in by_key["rows"]} == {ALPHA_ID: 4, runtime_id: 1}
    assert by_key["total"]["requests"] == 5
    csv_text = run_report(ledger_url, "--by", "user", "--format", "csv")
    assert csv_text.splitlines()[0].startswith("tenant,user,requests")
    assert "alpha,ann,2," in csv_text


def test_tenant_page_shows_the_breakdowns(gateway: tuple[str, str]) -> None:
    url, runtime_id = gateway
    page = httpx.get(url + "/dashboard/tenants/alpha", headers=ADMIN)
    assert page.status_code == 200
    html = page.text

    def requests_in(table: str, attribute: str, value: str) -> str:
        section = re.search(rf'<table class="usage" id="{table}">(.*?)</table>', html, re.S)
        assert section is not None, table
        row = re.search(rf'<tr data-{attribute}="{re.escape(value)}">(.*?)</tr>', section[1], re.S)
        assert row is not None, (table, value)
        found = re.search(r'data-k="requests">([^<]*)<', row[1])
        assert found is not None
        return found[1]

    assert requests_in("by-key", "key", ALPHA_ID) == "4"
    assert requests_in("by-key", "key", runtime_id) == "1"
    assert requests_in("by-user", "user", "ann") == "2"
    assert requests_in("by-tag", "tag", "search") == "2"
    assert requests_in("by-tag", "tag", "") == "2"
    assert 'data-api="by_tag"' in html
