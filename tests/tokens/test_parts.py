"""Text in content parts, Messages blocks and Responses items counts as text: a real gateway
over the mock backend, Qwen2.5's tokenizer and template, and the real openai and anthropic SDKs.
A part the gateway once counted as a fixed image estimate (765 tokens) carried any amount of
prompt past `max_input_tokens` and `tokens_per_minute`."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import anthropic
import httpx
import openai
import pytest

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from proxy.tokens import MEDIA_TOKENS, MEDIA_TOKENS_LOW, TokenCounter, load_counter
from proxy.tools.mock import backend as mockbackend
from tests.servers import serve
from tests.shared import tokenizer_file

E = TypeVar("E", bound=Exception)
STRICT_KEY = "tw-parts-strict"
TPM_KEY = "tw-parts-tpm"
LIMIT = 1000
# About 3,000 tokens on Qwen2.5: over the limits below, where an image's 765 tokens are not.
BIG = "The quick brown fox jumps over the lazy dog. " * 300


def _qwen_spec() -> str:
    return f"{tokenizer_file('qwen2.5/qwen.tiktoken')}#qwen2.5"


@pytest.fixture(scope="module")
def qwen() -> TokenCounter:
    return load_counter(_qwen_spec(), model="qwen")


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[str, str]]:
    """(gateway URL, backend URL): one tenant with an input limit, one with a token rate."""
    with serve(mockbackend.create_app(ttft_ms=0, tokens_per_second=2000)) as backend_url:
        text = f"""
storage: memory
upstream: {{connect_timeout: 2s, read_timeout: 10s}}
backends:
  - name: mock
    url: {backend_url}/v1
    models: [mock-llm]
models:
  mock-llm: {{tokenizer: "{_qwen_spec()}"}}
tenants:
  strict:
    api_keys: [{hash_key(STRICT_KEY)}]
    models: [mock-llm]
    budget: {{max_input_tokens: {LIMIT}, on_input_overflow: reject}}
  tpm:
    api_keys: [{hash_key(TPM_KEY)}]
    models: [mock-llm]
    limits: {{tokens_per_minute: {LIMIT}}}
"""
        with serve(create_app(parse_policy(text, file="parts.yaml", environ={}))) as url:
            yield url, backend_url


def _backend_requests(backend_url: str) -> int:
    total: int = httpx.get(backend_url + "/mock/stats", timeout=10).json()["requests_total"]
    return total


@contextmanager
def _refused(backend_url: str, error: type[E]) -> Iterator[pytest.ExceptionInfo[E]]:
    """The block raises `error`, and the backend got no request meanwhile."""
    before = _backend_requests(backend_url)
    with pytest.raises(error) as refused:
        yield refused
    assert _backend_requests(backend_url) == before


HIDDEN_IN_CHAT_PARTS = {
    "thinking": [{"type": "thinking", "thinking": BIG}],
    "thinking beside a low-detail image_url": [
        {"type": "thinking", "thinking": BIG, "image_url": {"detail": "low"}}
    ],
    "refusal beside a null text": [{"type": "refusal", "text": None, "refusal": BIG}],
    "a text part whose text is null": [{"type": "text", "text": None, "refusal": BIG}],
    "tool_reference": [{"type": "tool_reference", "name": BIG}],
    "an unknown type": [{"type": "note", "body": {"lines": [BIG]}}],
    "no type": [{"tool_reference": True, "name": BIG}],
}


@pytest.mark.parametrize("content", HIDDEN_IN_CHAT_PARTS.values(), ids=HIDDEN_IN_CHAT_PARTS)
def test_text_in_any_chat_part_counts_against_max_input_tokens(
    gateway: tuple[str, str], content: list[dict[str, Any]]
) -> None:
    assert _strict_chat_refused(gateway, content).code == "context_length_exceeded"


def _strict_chat_refused(
    gateway: tuple[str, str], content: list[dict[str, Any]]
) -> openai.BadRequestError:
    """The strict tenant's chat of `content`, refused before the backend saw it."""
    url, backend_url = gateway
    with (
        openai.OpenAI(base_url=url + "/v1", api_key=STRICT_KEY, max_retries=0) as sdk,
        _refused(backend_url, openai.BadRequestError) as refused,
    ):
        sdk.chat.completions.create(
            model="mock-llm",
            max_tokens=5,
            messages=[{"role": "user", "content": content}],  # type: ignore[list-item]
        )
    return refused.value


def test_a_thinking_part_is_charged_its_text_against_tokens_per_minute(
    gateway: tuple[str, str],
) -> None:
    url, backend_url = gateway
    with (
        openai.OpenAI(base_url=url + "/v1", api_key=TPM_KEY, max_retries=0) as sdk,
        _refused(backend_url, openai.RateLimitError) as refused,
    ):
        sdk.chat.completions.create(
            model="mock-llm",
            max_tokens=5,
            messages=[{"role": "user", "content": [{"type": "thinking", "thinking": BIG}]}],  # type: ignore[list-item]
        )
    assert "can never be admitted" in refused.value.message


_DOCUMENT = {
    "type": "document",
    "source": {"type": "text", "media_type": "text/plain", "data": BIG},
}
_SEARCH_RESULT = {
    "type": "search_result",
    "source": "https://example.com",
    "title": "t",
    "content": [{"type": "text", "text": BIG}],
}
_CALL = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
_RESULT_DOCUMENT = {"type": "tool_result", "tool_use_id": "t", "content": [_DOCUMENT]}
_RESULT_SEARCH = {"type": "tool_result", "tool_use_id": "t", "content": [_SEARCH_RESULT]}
_IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": BIG}}
_RESULT_IMAGE = {"type": "tool_result", "tool_use_id": "t", "content": [_IMAGE]}
HIDDEN_IN_MESSAGES = {
    "a text document": [{"role": "user", "content": [_DOCUMENT]}],
    "a search result": [{"role": "user", "content": [_SEARCH_RESULT]}],
    "a document in a tool result": [
        {"role": "assistant", "content": [_CALL]},
        {"role": "user", "content": [_RESULT_DOCUMENT]},
    ],
    # vLLM writes a tool result into the prompt whole, an image's data as text.
    "an image in a tool result": [
        {"role": "assistant", "content": [_CALL]},
        {"role": "user", "content": [_RESULT_IMAGE]},
    ],
    # vLLM writes an assistant's tool result into its text whole.
    "an assistant's tool result": [
        {"role": "user", "content": "Go on."},
        {"role": "assistant", "content": [_RESULT_SEARCH]},
    ],
}


@pytest.mark.parametrize("messages", HIDDEN_IN_MESSAGES.values(), ids=HIDDEN_IN_MESSAGES)
def test_text_in_any_messages_block_counts_against_max_input_tokens(
    gateway: tuple[str, str], messages: list[dict[str, Any]]
) -> None:
    url, backend_url = gateway
    with (
        anthropic.Anthropic(base_url=url, api_key=STRICT_KEY, max_retries=0) as sdk,
        _refused(backend_url, anthropic.BadRequestError) as refused,
    ):
        sdk.messages.create(model="mock-llm", max_tokens=5, messages=messages)  # type: ignore[arg-type]
    assert f"limit of {LIMIT} input tokens" in refused.value.message


HIDDEN_IN_RESPONSES = {
    "a refusal part": {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "refusal", "refusal": BIG}],
    },
    "a custom tool's output": {"type": "custom_tool_call_output", "call_id": "c", "output": BIG},
    "a reasoning summary": {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [{"type": "summary_text", "text": BIG}],
    },
}


@pytest.mark.parametrize("item", HIDDEN_IN_RESPONSES.values(), ids=HIDDEN_IN_RESPONSES)
def test_text_in_any_responses_item_counts_against_max_input_tokens(
    gateway: tuple[str, str], item: dict[str, Any]
) -> None:
    url, backend_url = gateway
    with (
        openai.OpenAI(base_url=url + "/v1", api_key=STRICT_KEY, max_retries=0) as sdk,
        _refused(backend_url, openai.BadRequestError) as refused,
    ):
        sdk.responses.create(model="mock-llm", input=[item, {"role": "user", "content": "Hi"}])  # type: ignore[list-item]
    assert refused.value.code == "context_length_exceeded"


def _count(qwen: TokenCounter, content: object) -> int:
    return qwen.count_chat([{"role": "user", "content": content}])


def test_media_parts_count_the_estimate_however_large_their_data(qwen: TokenCounter) -> None:
    """Not their data as text: a 300 KB image is 765 tokens, at low detail 85, in chat's
    shape and in the Responses API's (detail beside the URL)."""
    data = "data:image/png;base64," + base64.b64encode(bytes(300_000)).decode()
    empty = _count(qwen, [])
    image = {"type": "image_url", "image_url": {"url": data}}
    low = {"type": "image_url", "image_url": {"url": data, "detail": "low"}}
    responses_low = {"type": "input_image", "image_url": data, "detail": "low"}
    audio = {"type": "input_audio", "input_audio": {"data": data[22:], "format": "wav"}}
    assert _count(qwen, [image]) - empty == MEDIA_TOKENS
    assert _count(qwen, [low]) - empty == MEDIA_TOKENS_LOW
    assert _count(qwen, [responses_low]) - empty == MEDIA_TOKENS_LOW
    assert _count(qwen, [audio]) - empty == MEDIA_TOKENS


def test_every_text_part_type_counts_its_own_field_as_text(qwen: TokenCounter) -> None:
    """thinking and refusal (beside a null text) count exactly as the same text in a text
    part: what vLLM renders of them."""
    plain = _count(qwen, [{"type": "text", "text": BIG}])
    assert _count(qwen, [{"type": "thinking", "thinking": BIG}]) == plain
    assert _count(qwen, [{"type": "refusal", "text": None, "refusal": BIG}]) == plain
    assert _count(qwen, [{"type": "input_text", "text": BIG}]) == plain
    unknown = _count(qwen, [{"type": "note", "body": BIG}])
    assert unknown >= plain  # its JSON: the text and a few tokens of keys


SIBLING_LOW_DETAIL = {
    "a video": {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}},
    "an audio": {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
    "a high-detail image": {
        "type": "image_url",
        "image_url": {"url": "https://example.com/i.png", "detail": "high"},
    },
}


@pytest.mark.parametrize("part", SIBLING_LOW_DETAIL.values(), ids=SIBLING_LOW_DETAIL)
def test_a_low_detail_no_backend_reads_does_not_lower_a_parts_count(
    gateway: tuple[str, str], part: dict[str, Any]
) -> None:
    """`detail: low` beside any media part counted it 85 tokens, not 765: OpenAI reads the
    detail only inside chat's `image_url` (or beside a Responses `input_image`'s URL), so two
    videos, audios or high-detail images, each with a `detail` no backend reads beside it,
    passed a 1,000-token `max_input_tokens` counted at 170."""
    content = [{**part, "detail": "low"}, {**part, "detail": "low"}, {"type": "text", "text": "?"}]
    refused = _strict_chat_refused(gateway, content)
    assert refused.code == "context_length_exceeded"
    counted = int(refused.message.split("input is ")[1].split()[0])
    assert counted > 2 * MEDIA_TOKENS


def test_every_key_of_a_responses_function_tool_counts_against_max_input_tokens(
    gateway: tuple[str, str],
) -> None:
    """vLLM hands a Responses function tool to the chat template whole (`tojson` writes every
    key), but only its name, description and parameters were counted: 3,000 tokens in any
    other key of it passed a 1,000-token max_input_tokens."""
    url, backend_url = gateway
    function = {"type": "function", "name": "f", "parameters": {}}
    with openai.OpenAI(base_url=url + "/v1", api_key=STRICT_KEY, max_retries=0) as sdk:
        fits = sdk.responses.create(model="mock-llm", input="Hi", tools=[function])  # type: ignore[list-item]
        with _refused(backend_url, openai.BadRequestError) as refused:
            hidden = {**function, "notes": BIG}
            sdk.responses.create(model="mock-llm", input="Hi", tools=[hidden])  # type: ignore[list-item]
    assert fits.status == "completed"
    assert refused.value.code == "context_length_exceeded"
