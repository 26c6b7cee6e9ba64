"""A request a degradation rule sends to another model, as the client and the ledger see it:
counted, limited and billed as that model's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest
from anthropic.types import MessageParam

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from tests.servers import serve
from tests.web.lyingbackend import LyingBackend, lying_backend
from tests.web.test_billing import ledger_records, qwen_spec

KEY = "tw-spill-tenant"
AUTH = {"authorization": f"Bearer {KEY}"}
SPILL = "[{name: spill, when: {}, then: {model: exact-small}}]"
SPILL_MOCK = SPILL.replace("exact-small", "mock-small")
# Chinese: the estimate of a model without a tokenizer counts 2/3 of a token a character,
# Qwen2.5's tokenizer more for this text (two repeats: 18 against 37, five: 34 against 49).
PHRASE = "数据库连接池配置"


def spill_policy(backend_url: str, ledger: Path, *, budget: str, degrade: str = SPILL) -> str:
    return f"""
storage: memory
ledger: sqlite:///{ledger}
backends: [{{name: b, url: "{backend_url}/v1", models: [guess-big, exact-small]}}]
models:
  guess-big: {{}}
  exact-small: {{tokenizer: "{qwen_spec()}"}}
tenants:
  t:
    api_keys: [{hash_key(KEY)}]
    models: [guess-big]
    budget: {budget}
    degrade: {degrade}
"""


@pytest.fixture
def liar() -> Iterator[tuple[LyingBackend, str]]:
    with lying_backend() as found:
        found[0].usage = None  # the gateway's own count is the bill
        yield found


def ask(url: str, repeats: int) -> httpx.Response:
    messages = [{"role": "user", "content": PHRASE * repeats}]
    body = {"model": "guess-big", "messages": messages, "max_tokens": 20}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=10)


def test_a_spilled_prompt_is_held_to_the_input_limit_by_the_serving_models_tokenizer(
    liar: tuple[LyingBackend, str], tmp_path: Path
) -> None:
    """Counted by the asked model's estimate (34 tokens) the prompt fit a 40-token limit, and
    was sent to a model whose tokenizer reads 49: a prompt that model's own clients are refused."""
    backend, backend_url = liar
    text = spill_policy(backend_url, tmp_path / "l.db", budget="{max_input_tokens: 40}")
    with serve(create_app(parse_policy(text, environ={}))) as url:
        refused = ask(url, 5)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    assert "49 tokens" in refused.json()["error"]["message"]
    assert refused.headers["x-tokenweir-degraded"] == "spill"  # why the count is not the client's
    assert backend.requests == 0


def test_a_spilled_request_without_backend_usage_bills_the_serving_models_count(
    liar: tuple[LyingBackend, str], tmp_path: Path
) -> None:
    """The backend reports no usage: the bill is the gateway's count. It was the asked model's
    estimate (18 tokens), labelled an exact count of the model that served it (37)."""
    backend, backend_url = liar
    ledger = tmp_path / "l.db"
    text = spill_policy(backend_url, ledger, budget="{tokens_per_day: 100000}")
    with serve(create_app(parse_policy(text, environ={}))) as url:
        answer = ask(url, 2)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-tokenweir-degraded"] == "spill"
    assert b'"model":"exact-small"' in backend.last_body
    [record] = ledger_records(ledger, 1)
    billed = (record.model, record.input_tokens, record.usage_source)
    assert billed == ("exact-small", 37, "counted")


def test_a_spill_rule_leaves_an_embedding_with_its_own_model(
    backend_url: str, backend: httpx.Client
) -> None:
    """A tenant's spill rule sent its embeddings to the rule's chat model: vectors of another
    model's space, which the client mixed into an index of its own model's."""
    text = f"""
backends: [{{name: a, url: "{backend_url}/v1", models: [mock-llm, mock-small, mock-embed]}}]
models: {{mock-llm: {{}}, mock-small: {{}}, mock-embed: {{}}}}
tenants:
  t: {{api_keys: [{hash_key(KEY)}], models: [mock-llm, mock-embed], degrade: {SPILL_MOCK}}}
"""
    body = {"model": "mock-embed", "input": "hello"}
    with serve(create_app(parse_policy(text, environ={}))) as url:
        answer = httpx.post(url + "/v1/embeddings", json=body, headers=AUTH)
        chat = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]}
        spilled = httpx.post(url + "/v1/chat/completions", json=chat, headers=AUTH)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "mock-embed"
    assert spilled.json()["model"] == "mock-small"  # the rule fires: chats are spilled


def test_count_tokens_counts_for_the_model_a_live_spill_rule_sends_the_request_to(
    liar: tuple[LyingBackend, str], tmp_path: Path
) -> None:
    """The count a client checks its prompt with is the one the gateway holds it to: while the
    rule fires, the serving model's 49 tokens (it said the asked model's 34, and the request
    that fit by it was refused at 40), and the answer names the rule."""
    _, backend_url = liar
    text = spill_policy(backend_url, tmp_path / "l.db", budget="{max_input_tokens: 40}")
    messages: list[MessageParam] = [{"role": "user", "content": PHRASE * 5}]
    with serve(create_app(parse_policy(text, environ={}))) as url:
        with anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0) as client:
            counted = client.messages.with_raw_response.count_tokens(
                model="guess-big", messages=messages
            )
        refused = ask(url, 5)
    assert counted.parse().input_tokens == 49
    assert counted.headers["x-tokenweir-degraded"] == "spill"
    assert "49 tokens" in refused.json()["error"]["message"]
