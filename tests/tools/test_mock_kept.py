"""The mock backend's stored Responses, as OpenAI keeps them, read with the openai SDK direct
and through a gateway: stored unless `store: false`, read back, deleted, continued."""

from __future__ import annotations

from pathlib import Path

import openai
import orjson
import pytest

from proxy.app import create_app as create_gateway
from proxy.tools.mock.kept import KeptResponses, Transcript
from proxy.tools.mock.request import MockHTTPError
from tests.servers import serve
from tests.tools.test_mock_toolcalls import mock_url, sdk
from tests.web.test_billing import AUTH, billing_policy, ledger_records

__all__ = ["mock_url", "sdk"]  # fixtures

STORY = 3 + 4  # "a story please": three words, plus the mock's 4 a message


def test_a_response_is_stored_read_back_continued_and_deleted_as_openai_does(
    sdk: openai.OpenAI,
) -> None:
    """The mock said `store: false` whatever was asked, kept nothing, had no GET, and took any
    `previous_response_id` (a made-up one too) as if it were not there."""
    first = sdk.responses.create(model="m", input="a story please", max_output_tokens=5)
    assert first.store is True
    assert first.usage is not None
    assert first.usage.input_tokens == STORY
    read = sdk.responses.retrieve(first.id)
    assert (read.id, read.output_text, read.usage) == (first.id, first.output_text, first.usage)
    second = sdk.responses.create(
        model="m", input="and then", previous_response_id=first.id, max_output_tokens=5
    )
    assert second.previous_response_id == first.id
    assert second.usage is not None
    # the stored conversation is read first: its input, its output as a message, then this one's
    assert second.usage.input_tokens == STORY + (5 + 4) + (2 + 4)
    stream = sdk.responses.create(
        model="m", input="more", previous_response_id=second.id, max_output_tokens=4, stream=True
    )
    ended = [e for e in stream if e.type == "response.incomplete"]
    streamed = ended[0].response
    assert sdk.responses.retrieve(streamed.id).output_text == streamed.output_text
    assert streamed.usage is not None
    assert streamed.usage.input_tokens == second.usage.input_tokens + (5 + 4) + (1 + 4)
    sdk.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.responses.create(model="m", input="on", previous_response_id=first.id)
    assert caught.value.code == "previous_response_not_found"
    assert caught.value.param == "previous_response_id"


def test_store_false_keeps_nothing_and_its_id_continues_nothing(sdk: openai.OpenAI) -> None:
    unstored = sdk.responses.create(model="m", input="hi", store=False, max_output_tokens=3)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.responses.create(model="m", input="on", previous_response_id=unstored.id)
    assert caught.value.code == "previous_response_not_found"


def test_the_oldest_responses_go_first_past_the_count_or_the_bytes_kept() -> None:
    kept = KeptResponses(max_responses=2, max_bytes=10_000)

    def keep(response_id: str, output: str) -> None:
        response = orjson.dumps({"id": response_id})
        kept.keep(response, Transcript("question", 1), output, len(output.split()))

    for response_id in ("resp_1", "resp_2", "resp_3"):
        keep(response_id, "an answer")
    with pytest.raises(MockHTTPError):
        kept.history({"previous_response_id": "resp_1"})
    assert kept.history({"previous_response_id": "resp_3"}) == Transcript(
        "question\nan answer", 1 + 2 + 4
    )
    keep("resp_4", "word " * 2500)  # about 12,500 bytes: past the bound, so the others go
    for gone in ("resp_2", "resp_3", "resp_4"):
        with pytest.raises(MockHTTPError):
            kept.history({"previous_response_id": gone})


def test_a_gateway_continues_a_response_the_mock_stored(mock_url: str, tmp_path: Path) -> None:
    """Through tokenweir: the mock's `store: false` left the gateway nothing to remember, so
    every `previous_response_id` was a 404 there; now the turn goes on, billed its history."""
    ledger = tmp_path / "ledger.db"
    with serve(create_gateway(billing_policy(mock_url, ledger))) as gateway:
        with openai.OpenAI(
            base_url=gateway + "/v1", api_key=AUTH["authorization"][7:], max_retries=0
        ) as client:
            first = client.responses.create(
                model="exact-llm", input="a story please", max_output_tokens=5
            )
            second = client.responses.create(
                model="exact-llm",
                input="and then",
                previous_response_id=first.id,
                max_output_tokens=5,
            )
    assert second.previous_response_id == first.id
    _, record = ledger_records(ledger, 2)
    assert (record.usage_source, record.input_tokens) == ("backend", STORY + (5 + 4) + (2 + 4))
