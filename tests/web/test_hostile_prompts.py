"""Prompts built to trouble the tokenizer, through a real gateway counting with Qwen2.5's
tokenizer (tiktoken) over the real mock backend: each gets an answer or an OpenAI-shaped 4xx."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from proxy.policy.units import hash_key
from proxy.tools.mock import backend as mockbackend
from tests.web.agentgateway import exact_gateway

KEY = "tw-hostile-prompts"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    ledger: Path = tmp_path_factory.mktemp("hostile") / "ledger.db"
    tenants = f"""  alpha:
    api_keys: [{hash_key(KEY)}]
    models: [exact-llm]
    budget: {{max_input_tokens: 100000}}
"""
    backend = mockbackend.create_app(ttft_ms=0, tokens_per_second=2000)
    with exact_gateway(backend, ledger, tenants) as url:
        yield url


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": " " * 1_100_000}]}),
        ("/v1/completions", {"prompt": "Hi" + "\t" * 1_100_000}),
    ],
)
def test_a_million_blanks_in_a_row_are_counted_and_answered(
    gateway: str, path: str, body: dict[str, object]
) -> None:
    """tiktoken panics on such a run; the gateway answered a bare 500 `Internal Server Error`."""
    request = {"model": "exact-llm", "max_tokens": 3, **body}
    answer = httpx.post(gateway + path, json=request, headers=AUTH, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 3
