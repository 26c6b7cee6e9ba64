"""The mock backend's Responses and Messages APIs, read by the real openai and anthropic SDKs
straight from the mock: the shapes the gateway's tests rely on are the real APIs' shapes."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from proxy.tools.mock import backend as mockbackend
from tests.servers import serve

QUESTION = "Name three rivers of Europe."  # 5 words: 9 prompt tokens with the per-message 4


@pytest.fixture(scope="module")
def mock_url() -> Iterator[str]:
    with serve(mockbackend.create_app(ttft_ms=0, tokens_per_second=5000)) as url:
        yield url


def test_a_response_has_openais_shape_and_usage(mock_url: str) -> None:
    with openai.OpenAI(base_url=mock_url + "/v1", api_key="x", max_retries=0) as client:
        response = client.responses.create(
            model="mock-llm",
            instructions="Be brief.",
            input=QUESTION,
            extra_body={"mock_completion_tokens": 6},
        )
    assert response.object == "response"
    assert response.status == "completed"
    assert response.output[0].type == "message"
    assert len(response.output_text.split()) == 6
    assert response.usage is not None
    assert response.usage.input_tokens == (2 + 4) + (5 + 4)  # instructions and input
    assert response.usage.output_tokens == 6
    assert response.usage.total_tokens == 15 + 6


def test_max_output_tokens_makes_a_response_incomplete(mock_url: str) -> None:
    with openai.OpenAI(base_url=mock_url + "/v1", api_key="x", max_retries=0) as client:
        response = client.responses.create(model="mock-llm", input=QUESTION, max_output_tokens=4)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None
    assert response.usage.output_tokens == 4


def test_a_response_stream_is_the_openai_event_sequence(mock_url: str) -> None:
    with (
        openai.OpenAI(base_url=mock_url + "/v1", api_key="x", max_retries=0) as client,
        client.responses.stream(
            model="mock-llm", input=QUESTION, extra_body={"mock_completion_tokens": 5}
        ) as stream,
    ):
        events = list(stream)
        final = stream.get_final_response()
    types = [event.type for event in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 5,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == deltas
    assert final.usage is not None
    assert (final.usage.input_tokens, final.usage.output_tokens) == (9, 5)


def test_a_message_has_anthropics_shape_and_usage(mock_url: str) -> None:
    with anthropic.Anthropic(base_url=mock_url, api_key="x", max_retries=0) as client:
        message = client.messages.create(
            model="mock-llm",
            max_tokens=3,
            system="Be brief.",
            messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
        )
    assert message.type == "message"
    assert message.role == "assistant"
    assert message.stop_reason == "max_tokens"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (6 + 9, 3)


def test_a_message_stream_is_the_anthropic_event_sequence(mock_url: str) -> None:
    with (
        anthropic.Anthropic(base_url=mock_url, api_key="x", max_retries=0) as client,
        client.messages.stream(
            model="mock-llm",
            max_tokens=100,
            messages=[{"role": "user", "content": QUESTION}],
            extra_body={"mock_completion_tokens": 4},
        ) as stream,
    ):
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert [e for e in events if e not in ("text",)] == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 4,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert final.stop_reason == "end_turn"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (9, 4)


def test_the_raw_message_stream_names_every_event_and_pings(mock_url: str) -> None:
    body = {
        "model": "mock-llm",
        "max_tokens": 2,
        "stream": True,
        "messages": [{"role": "user", "content": QUESTION}],
    }
    answer = httpx.post(mock_url + "/v1/messages", json=body, timeout=10)
    names = [
        line[len("event: ") :] for line in answer.text.splitlines() if line.startswith("event:")
    ]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-1] == "message_stop"
    assert answer.text.count("\ndata: ") + answer.text.startswith("data: ") == len(names)


def test_messages_errors_are_anthropic_shaped(mock_url: str) -> None:
    with anthropic.Anthropic(base_url=mock_url, api_key="x", max_retries=0) as client:
        with pytest.raises(anthropic.BadRequestError) as missing:
            client.post(
                "/v1/messages",
                body={"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]},
                cast_to=httpx.Response,
            )
        with pytest.raises(anthropic.RateLimitError) as failed:
            client.messages.create(
                model="mock-llm",
                max_tokens=5,
                messages=[{"role": "user", "content": "hi"}],
                extra_body={"mock_fail": 429},
            )
    assert missing.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"},
    }
    assert isinstance(failed.value.body, dict)
    assert failed.value.body["error"]["type"] == "rate_limit_error"
