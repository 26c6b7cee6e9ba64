"""The mock backend's `n` > 1 streams, over real HTTP as the openai SDK reads them, and as a
gateway in front of it relays and bills them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai

from proxy.app import create_app as create_gateway
from tests.servers import serve
from tests.tools.test_mock_toolcalls import mock_url, sdk
from tests.web.test_billing import AUTH, HELLO, billing_policy, ledger_records

MESSAGES: Any = [{"role": "user", "content": "tell me a story"}]
PROMPT_TOKENS = 4 + 4  # four words plus the mock's 4 per message

__all__ = ["mock_url", "sdk"]  # fixtures


def test_a_stream_of_n_choices_interleaves_them_as_openai_and_vllm_do(
    sdk: openai.OpenAI, mock_url: str
) -> None:
    """It was a 400 ("streams one answer"): each chunk now holds one choice with its `index`,
    every choice its role event, tokens and finish_reason; usage counts all of them."""
    whole = sdk.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, n=3)
    httpx.post(mock_url + "/mock/stats/reset")
    stream = sdk.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=4,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    *token_chunks, last = chunks
    assert all(len(chunk.choices) == 1 for chunk in token_chunks)
    indices = [chunk.choices[0].index for chunk in token_chunks]
    assert indices == [0, 1, 2] * (1 + 4)  # the role events, then each token of each choice
    texts = ["", "", ""]
    for chunk in token_chunks:
        texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert texts == [choice.message.content for choice in whole.choices]
    finishes = [(c.choices[0].index, c.choices[0].finish_reason) for c in token_chunks[-3:]]
    assert finishes == [(0, "length"), (1, "length"), (2, "length")]
    assert all(c.choices[0].finish_reason is None for c in token_chunks[:-3])
    assert last.choices == []
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (PROMPT_TOKENS, 3 * 4)
    assert httpx.get(mock_url + "/mock/stats").json()["tokens_sent"] == 3 * 4


def test_a_streamed_completions_batch_numbers_each_prompts_choices(sdk: openai.OpenAI) -> None:
    stream = sdk.completions.create(
        model="m",
        prompt=["one two", "three"],
        max_tokens=3,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    *chunks, last = list(stream)
    assert [chunk.choices[0].index for chunk in chunks] == [0, 1, 2, 3] * 3
    assert [c.choices[0].finish_reason for c in chunks[-4:]] == ["length"] * 4
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 4 * 3)


def test_a_gateway_relays_and_bills_every_streamed_choice(mock_url: str, tmp_path: Path) -> None:
    """Through tokenweir: the client gets all three choices, and the ledger bills 3 x 4 tokens
    from the backend's usage (the gateway asked for it; the client, not asking, sees none)."""
    ledger = tmp_path / "ledger.db"
    body = {"model": "exact-llm", "messages": HELLO, "n": 3, "max_tokens": 4, "stream": True}
    with serve(create_gateway(billing_policy(mock_url, ledger))) as gateway:
        with openai.OpenAI(
            base_url=gateway + "/v1", api_key=AUTH["authorization"][7:], max_retries=0
        ) as client:
            chunks = list(client.chat.completions.create(**body))
    assert all(chunk.usage is None for chunk in chunks)
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finished == [0, 1, 2]
    [record] = ledger_records(ledger, 1)
    assert (record.usage_source, record.input_tokens, record.output_tokens) == ("backend", 8, 12)
