"""`x-tokenweir-degraded` names a rule only when it changed the request (or the reservation a
429 refused), as the ledger and metrics record it; `count_tokens` is logged and its 429s counted."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anthropic
import openai
import pytest

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from tests.servers import serve
from tests.web.test_billing import ledger_records
from tests.web.test_metrics import scrape, value

KEY = "tw-degrade-header"
SHORTEN = "{name: shorten, when: {}, then: {max_output_tokens: 64}}"
SPILL_SHORT = "{name: spill, when: {}, then: {model: small, max_output_tokens: 64}}"


def policy_text(backend_url: str, ledger: Path, *, degrade: str, extra: str = "") -> str:
    return f"""
storage: memory
ledger: sqlite:///{ledger}
backends: [{{name: b, url: "{backend_url}/v1", models: [big, small]}}]
models: {{big: {{}}, small: {{}}}}
tenants:
  t:
    api_keys: [{hash_key(KEY)}]
    models: [big]
    degrade: [{degrade}]
{extra}"""


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    return tmp_path / "ledger.db"


@contextmanager
def gateway(backend_url: str, ledger: Path, degrade: str, extra: str = "") -> Iterator[str]:
    text = policy_text(backend_url, ledger, degrade=degrade, extra=extra)
    with serve(create_app(parse_policy(text, environ={}))) as url:
        yield url


def chat(url: str, max_tokens: int) -> openai.APIResponse[object]:
    with openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as client:
        return client.chat.completions.with_raw_response.create(
            model="big", messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens
        )


def test_an_output_rule_above_the_clients_bound_is_not_named(
    backend_url: str, ledger: Path
) -> None:
    """The client asked 10 tokens, the rule bounds at 64: nothing changed, and neither the
    answer, the ledger nor the metric say a rule degraded it; 500 tokens were shortened."""
    with gateway(backend_url, ledger, SHORTEN) as url:
        kept, shortened = chat(url, 10), chat(url, 500)
        assert "x-tokenweir-degraded" not in kept.headers
        assert shortened.headers["x-tokenweir-degraded"] == "shorten"
        assert value(scrape(url), "tokenweir_degraded_requests_total", rule="shorten") == 1
    records = ledger_records(ledger, 2)
    assert [r.degraded for r in records] == [(), ("shorten",)]


def test_a_spill_or_output_rule_does_not_name_itself_on_an_embeddings_request(
    backend_url: str, ledger: Path
) -> None:
    with gateway(backend_url, ledger, SPILL_SHORT) as url:
        with openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as client:
            answer = client.embeddings.with_raw_response.create(model="big", input="hi")
        assert answer.status_code == 200
        assert answer.parse().model == "big"  # not sent to the rule's model
        assert "x-tokenweir-degraded" not in answer.headers
        assert value(scrape(url), "tokenweir_degraded_requests_total") == 0
    assert ledger_records(ledger, 1)[0].degraded == ()


def test_a_quota_429_on_the_rules_reservation_names_the_rule(
    backend_url: str, ledger: Path
) -> None:
    """The quota reserved the rule's 64 output tokens, not the 500 asked, and still refused:
    the refusal names the rule whose reservation it was, as its ledger record does."""
    quota = "    budget: {tokens_per_day: 40}\n"
    with gateway(backend_url, ledger, SHORTEN, extra=quota) as url:
        with pytest.raises(openai.RateLimitError) as refused:
            chat(url, 500)
        assert refused.value.response.headers["x-tokenweir-degraded"] == "shorten"
        needed = re.search(r"needs up to (\d+) tokens", refused.value.message)
        assert needed is not None
        assert int(needed[1]) < 100  # the rule's 64 reserved, not the 500 asked
    assert ledger_records(ledger, 1)[0].degraded == ("shorten",)


def test_a_requests_per_minute_429_names_no_rule(backend_url: str, ledger: Path) -> None:
    """The second request is refused on its request count, which no rule changed."""
    limit = "    limits: {requests_per_minute: 1}\n"
    with gateway(backend_url, ledger, SHORTEN, extra=limit) as url:
        assert chat(url, 500).headers["x-tokenweir-degraded"] == "shorten"
        with pytest.raises(openai.RateLimitError) as refused:
            chat(url, 500)
        assert "x-tokenweir-degraded" not in refused.value.response.headers


def test_count_tokens_is_logged_and_its_429s_counted(
    backend_url: str, ledger: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    limit = "    limits: {requests_per_minute: 1}\n"
    with gateway(backend_url, ledger, SHORTEN, extra=limit) as url:
        with anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0) as client:
            messages: list[anthropic.types.MessageParam] = [{"role": "user", "content": "hi"}]
            counted = client.messages.count_tokens(model="big", messages=messages)
            with pytest.raises(anthropic.RateLimitError):
                client.messages.count_tokens(model="big", messages=messages)
        rejected = value(scrape(url), "tokenweir_rejected_requests_total", reason="rate_limit")
        assert rejected == 1
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "tokenweir.access"]
    assert [(line["operation"], line["status"]) for line in lines] == [
        ("count_tokens", 200),
        ("count_tokens", 429),
    ]
    assert lines[0]["counted_input_tokens"] == counted.input_tokens
    assert lines[1]["tenant"] == "t"
    assert all(line["cost_usd"] == 0 for line in lines)
    assert ledger_records(ledger, 0) == []  # nothing billed, no record
