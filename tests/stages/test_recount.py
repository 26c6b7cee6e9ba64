"""A request a fallback model serves, through a real `tokenweir serve`: counted, limited, trimmed
and billed with the fallback's tokenizer (Llama 3's), not the asked model's (o200k_base)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import orjson
import pytest

from proxy.policy.units import hash_key
from tests.servers import free_port, replicas
from tests.shared import offline_tiktoken, tokenizer_file
from tests.web.lyingbackend import LyingBackend, lying_backend
from tests.web.test_billing import ledger_records

KEY = "tw-fallback-count-tenant"
# o200k_base reads this as 18 tokens in a chat, Llama 3's template and tokenizer as 45 (one
# repeat: 10 against 37).
PHRASE = "hello world "


@pytest.fixture
def fallback(tmp_path: Path) -> Iterator[tuple[LyingBackend, str, Path]]:
    """The fallback model's backend (no usage in its answers: the gateway's count is the bill)
    and the policy's path; the asked model's only backend refuses every connection."""
    (tmp_path / "tiktoken").mkdir()
    with offline_tiktoken(tmp_path / "tiktoken"), lying_backend() as (backend, url):
        backend.usage = None
        yield backend, url, tmp_path / "policy.yaml"


def write_policy(path: Path, backend_url: str, budget: str) -> None:
    llama = tokenizer_file("llama-3/tokenizer.json")
    path.write_text(f"""
storage: memory
ledger: sqlite:///{path.parent / "ledger.db"}
upstream: {{probe_interval: 0, circuit: {{failures: 1, open_for: 60s}}}}
backends:
  - {{name: dead, url: "http://127.0.0.1:{free_port()}/v1", models: [gpt-big]}}
  - {{name: small, url: "{backend_url}/v1", models: [llama-small]}}
models:
  gpt-big: {{tokenizer: "tiktoken:o200k_base", fallback_models: [llama-small]}}
  llama-small: {{tokenizer: "{llama}"}}
tenants:
  t: {{api_keys: [{hash_key(KEY)}], models: [gpt-big], budget: {budget}}}
""")


def ask(url: str, messages: list[dict[str, str]], stream: bool = False) -> dict[str, str]:
    """The answer's headers, once it has been read whole."""
    with openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as sdk:
        answer = sdk.chat.completions.with_raw_response.create(
            model="gpt-big", messages=messages, max_tokens=5, stream=stream
        )
        parsed = answer.parse()
        assert list(parsed) if stream else parsed.choices
        return dict(answer.headers)


def test_a_prompt_over_the_input_limit_by_the_fallbacks_count_is_refused_naming_it(
    fallback: tuple[LyingBackend, str, Path],
) -> None:
    """18 tokens by the asked model fit a 30-token limit; the fallback that serves it reads 45
    and got it, both when the asked model's backend failed at connect (the first request) and
    when its circuit was already open (the second)."""
    backend, backend_url, config = fallback
    write_policy(config, backend_url, "{max_input_tokens: 30}")
    with replicas(config, 1) as [(_, url)]:
        errors = []
        for _ in range(2):
            with pytest.raises(openai.BadRequestError) as refused:
                ask(url, [{"role": "user", "content": PHRASE * 5}])
            errors.append(refused.value)
    for error in errors:
        assert error.code == "context_length_exceeded"
        assert "is 45 tokens" in error.message
        assert "'llama-small', the fallback model" in error.message
    assert backend.requests == 0


def test_a_fallbacks_count_is_the_bill_of_an_answer_without_usage(
    fallback: tuple[LyingBackend, str, Path],
) -> None:
    _, backend_url, config = fallback
    write_policy(config, backend_url, "{tokens_per_day: 100000}")
    with replicas(config, 1) as [(_, url)]:
        ask(url, [{"role": "user", "content": PHRASE * 5}])
    [record] = ledger_records(config.parent / "ledger.db", 1)
    billed = (record.model, record.input_tokens, record.usage_source)
    assert billed == ("llama-small", 45, "counted")  # was o200k_base's 18


def test_a_history_is_trimmed_to_the_fallbacks_count(
    fallback: tuple[LyingBackend, str, Path],
) -> None:
    """The turns fit 60 tokens by the asked model's count (40), not by the fallback's (68):
    it gets the newest turn alone (37), as its own clients would. A stream: the body sent
    after the asked model's backend failed is a copy (it asks for usage), not the shaped one."""
    backend, backend_url, config = fallback
    write_policy(config, backend_url, "{max_input_tokens: 60, on_input_overflow: trim}")
    turns = [
        {"role": "user", "content": PHRASE * 10},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": PHRASE},
    ]
    with replicas(config, 1) as [(_, url)]:
        headers = ask(url, turns, stream=True)
    assert orjson.loads(backend.last_body)["messages"] == turns[2:]
    assert headers["x-tokenweir-shaped"] == "input"
