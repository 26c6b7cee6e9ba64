"""Text in a tool's schema counts, on OpenAI's rule too: a real gateway over the mock backend,
the o200k_base encoding, and the real openai SDK. The rule renders a schema's names, types,
descriptions and enums only, so text in any other key (`examples`, `default`, `$defs`) passed
`max_input_tokens` uncounted, though a backend may put the whole schema in the prompt."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from proxy.tools.mock import backend as mockbackend
from tests.servers import serve
from tests.shared import tokenizer_file

KEY = "tw-schemas-strict"
LIMIT = 1000
HIDDEN = "The quick brown fox jumps over the lazy dog. " * 300  # about 3,000 tokens


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[str, str]]:
    """(gateway URL, backend URL): one tenant with an input limit, on o200k_base's rule."""
    spec = tokenizer_file("o200k_base.tiktoken")
    with serve(mockbackend.create_app(ttft_ms=0, tokens_per_second=2000)) as backend_url:
        text = f"""
storage: memory
backends: [{{name: mock, url: "{backend_url}/v1", models: [mock-llm]}}]
models: {{mock-llm: {{tokenizer: "{spec}"}}}}
tenants:
  strict:
    api_keys: [{hash_key(KEY)}]
    models: [mock-llm]
    budget: {{max_input_tokens: {LIMIT}, on_input_overflow: reject}}
"""
        with serve(create_app(parse_policy(text, file="schemas.yaml", environ={}))) as url:
            yield url, backend_url


def _tool(parameters: dict[str, Any]) -> dict[str, Any]:
    function = {"name": "lookup", "description": "Look a word up.", "parameters": parameters}
    return {"type": "function", "function": function}


def _word(**extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {"word": {"type": "string", **extra}}}


def _asked(backend_url: str) -> int:
    total: int = httpx.get(backend_url + "/mock/stats", timeout=10).json()["requests_total"]
    return total


@pytest.mark.parametrize(
    "parameters",
    [
        _word(examples=[HIDDEN]),
        _word(default=HIDDEN),
        {**_word(), "$defs": {"Note": {"type": "string", "description": HIDDEN}}},
    ],
    ids=["examples", "default", "defs"],
)
def test_text_anywhere_in_a_tools_schema_counts_against_max_input_tokens(
    gateway: tuple[str, str], parameters: dict[str, Any]
) -> None:
    url, backend_url = gateway
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    messages: Any = [{"role": "user", "content": "Define fox."}]
    before = _asked(backend_url)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="mock-llm", messages=messages, max_tokens=3, tools=[_tool(parameters)]
        )
    assert refused.value.code == "context_length_exceeded"
    assert _asked(backend_url) == before
    # The same tool without the hidden text is an ordinary request.
    answer = client.chat.completions.create(
        model="mock-llm", messages=messages, max_tokens=3, tools=[_tool(_word())]
    )
    assert answer.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert _asked(backend_url) == before + 1
