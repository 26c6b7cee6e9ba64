"""`POST /v1/responses` through the gateway, with the real openai SDK, over the real mock backend:
billed from the Responses usage, capped, quota'd, checked, and cancelled when the client leaves."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from tests.web.agentgateway import (
    CACHED_KEY,
    CAPPED_KEY,
    OPEN_KEY,
    OUTPUT_CAP,
    POOR_KEY,
    PRICE_IN_NUSD_PER_TOKEN,
    PRICE_OUT_NUSD_PER_TOKEN,
    SHORT_KEY,
    SYSTEM_PROMPT,
    AgentGateway,
    agent_gateway,
    wait_for_stat,
)

QUESTION = "Name three rivers of Europe."


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentGateway]:
    with agent_gateway(Path(tmp_path_factory.mktemp("responses"))) as running:
        yield running


def sdk(gateway: AgentGateway, key: str = OPEN_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)


def test_a_whole_response_is_billed_from_its_usage(gateway: AgentGateway) -> None:
    with sdk(gateway) as client:
        raw = client.responses.with_raw_response.create(
            model="mock-llm", input=QUESTION, extra_body={"mock_completion_tokens": 7}
        )
    response = raw.parse()
    assert response.status == "completed"
    assert len(response.output_text.split()) == 7
    usage = response.usage
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens) == (5 + 4, 7)  # the mock's words + 4
    record = gateway.record(raw.headers["x-request-id"])
    assert (record.operation, record.status, record.stream) == ("responses", 200, False)
    assert (record.input_tokens, record.output_tokens) == (9, 7)
    assert record.usage_source == "backend"
    assert record.cost_nusd == 9 * PRICE_IN_NUSD_PER_TOKEN + 7 * PRICE_OUT_NUSD_PER_TOKEN


def test_a_streamed_response_is_relayed_event_by_event_and_billed(gateway: AgentGateway) -> None:
    with sdk(gateway) as client:
        stream = client.responses.create(
            model="mock-llm",
            input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
            stream=True,
            extra_body={"mock_completion_tokens": 12},
        )
        request_id = stream.response.headers["x-request-id"]
        events = list(stream)
    types = [event.type for event in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types.count("response.output_text.delta") == 12
    assert types[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    completed = events[-1]
    assert completed.type == "response.completed"
    assert completed.response.usage is not None
    assert completed.response.usage.output_tokens == 12
    record = gateway.record(request_id)
    assert (record.operation, record.stream, record.status) == ("responses", True, 200)
    assert (record.input_tokens, record.output_tokens) == (9, 12)
    assert record.usage_source == "backend"
    assert record.ttft_ms is not None  # metered on the first response.output_text.delta
    # A speed needs two reads with text: on a loaded machine the whole stream may arrive in one
    # read (first token = last token), and the speed is then unknown, not made up.
    assert record.tokens_per_s is None or record.tokens_per_s > 0


def test_the_output_cap_and_system_prompt_apply(gateway: AgentGateway) -> None:
    with sdk(gateway, CAPPED_KEY) as client:
        raw = client.responses.with_raw_response.create(
            model="mock-llm", input=QUESTION, instructions="Be kind.", max_output_tokens=100
        )
    response = raw.parse()
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None
    assert response.usage.output_tokens == OUTPUT_CAP
    sent = gateway.stats()["last_request"]
    assert isinstance(sent, dict)
    assert sent["max_output_tokens"] == OUTPUT_CAP
    assert "max_tokens" not in sent  # the Responses API's own field, not chat's
    assert sent["instructions"] == f"{SYSTEM_PROMPT}\n\nBe kind."
    assert set(raw.headers["x-tokenweir-shaped"].split(",")) == {"system_prompt", "max_tokens"}


def test_a_response_without_a_cap_gets_the_tenants(gateway: AgentGateway) -> None:
    with sdk(gateway, CAPPED_KEY) as client:
        response = client.responses.create(model="mock-llm", input=QUESTION)
    assert response.usage is not None
    assert response.usage.output_tokens == OUTPUT_CAP


def test_over_quota_is_a_429_that_bills_nothing(gateway: AgentGateway) -> None:
    gateway.reset()
    with sdk(gateway, POOR_KEY) as client, pytest.raises(openai.RateLimitError) as refused:
        client.responses.create(model="mock-llm", input=QUESTION, max_output_tokens=100)
    answer = refused.value.response
    assert answer.json()["error"]["code"] == "insufficient_quota"
    assert answer.headers["x-should-retry"] == "false"  # 100 tokens never fit in 50 a day
    record = gateway.record(answer.headers["x-request-id"])
    assert (record.status, record.input_tokens, record.output_tokens, record.cost_nusd) == (
        429,
        0,
        0,
        0,
    )
    assert gateway.stats()["requests_total"] == 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "mock-llm"}, "input"),
        ({"model": "mock-llm", "input": 42}, "input"),
        ({"model": "mock-llm", "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": "mock-llm", "input": "hi", "temperature": "warm"}, "temperature"),
    ],
)
def test_bad_input_is_an_openai_400_and_reaches_no_backend(
    gateway: AgentGateway, body: dict[str, object], param: str
) -> None:
    gateway.reset()
    answer = httpx.post(
        gateway.url + "/v1/responses",
        json=body,
        headers={"authorization": f"Bearer {OPEN_KEY}"},
        timeout=10,
    )
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert gateway.stats()["requests_total"] == 0


def test_unknown_fields_pass_through_untouched(gateway: AgentGateway) -> None:
    extra = {"top_k": 20, "reasoning": {"effort": "low"}, "truncation": "auto"}
    with sdk(gateway) as client:
        client.responses.create(model="mock-llm", input=QUESTION, extra_body=extra)
    sent = gateway.stats()["last_request"]
    assert isinstance(sent, dict)
    assert {name: sent[name] for name in extra} == extra
    assert "stream_options" not in sent


def test_a_client_that_leaves_cancels_the_backend(gateway: AgentGateway) -> None:
    gateway.reset()
    long = {"mock_completion_tokens": 20_000}
    with sdk(gateway) as client:
        stream = client.responses.create(
            model="mock-llm", input=QUESTION, stream=True, max_output_tokens=20_000, extra_body=long
        )
        request_id = stream.response.headers["x-request-id"]
        deltas = 0
        for event in stream:
            deltas += event.type == "response.output_text.delta"
            if deltas == 20:
                break
        # A stream that runs a while is checkpointed (about once a second): leave after that.
        checkpointed = time.monotonic() + 10
        while not any(r.checkpoint for r in gateway.records(request_id)):
            assert time.monotonic() < checkpointed, "no checkpoint of the running stream"
            time.sleep(0.05)
        stream.close()
    wait_for_stat(gateway, "streams_cancelled", 1)
    stats = gateway.stats()
    assert stats["streams_completed"] == 0
    record = gateway.record(request_id)
    assert gateway.records(request_id) == [record]  # the final record replaced the checkpoint
    assert record.client_disconnected is True
    # What was produced is billed, by the gateway's counts: the usage never came.
    assert record.usage_source == "counted"
    assert 20 <= record.output_tokens < 20_000
    assert record.input_tokens == record.counted_input_tokens > 0


def test_a_backend_dying_mid_stream_ends_in_an_error_the_sdk_raises(
    gateway: AgentGateway,
) -> None:
    knobs = {"mock_completion_tokens": 50, "mock_fail_after_tokens": 5}
    with sdk(gateway) as client, pytest.raises(openai.APIError):
        for _ in client.responses.create(
            model="mock-llm", input=QUESTION, stream=True, extra_body=knobs
        ):
            pass


def test_an_input_over_the_limit_is_refused_before_the_backend(gateway: AgentGateway) -> None:
    gateway.reset()
    long_input = "word " * 100
    with sdk(gateway, SHORT_KEY) as client, pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="mock-llm", input=long_input)
    assert refused.value.code == "context_length_exceeded"
    with sdk(gateway, SHORT_KEY) as client:
        assert client.responses.create(model="mock-llm", input="Hi").status == "completed"
    assert gateway.stats()["requests_total"] == 1


def test_a_custom_tools_grammar_counts_toward_the_input_limit(gateway: AgentGateway) -> None:
    """Only function tools were counted: a custom tool's grammar (which the backend puts in the
    prompt) carried any number of tokens past max_input_tokens."""
    gateway.reset()
    grammar = {"type": "grammar", "syntax": "lark", "definition": "start: " + "word " * 200}
    custom = {"type": "custom", "name": "parse", "description": "Parse it.", "format": grammar}
    with sdk(gateway, SHORT_KEY) as client, pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="mock-llm", input="Hi", extra_body={"tools": [custom]})
    assert refused.value.code == "context_length_exceeded"
    assert gateway.stats()["requests_total"] == 0


def test_a_stored_prompt_is_refused_under_an_input_limit(gateway: AgentGateway) -> None:
    """The backend would add a stored prompt template the gateway never counts: the key's input
    limit could not hold. Without a limit the request goes on to the backend. (A stored
    conversation, `previous_response_id`, the same: tests/web/test_stored_state.py, whose
    backend stores responses; mock-backend keeps none.)"""
    stored = {"prompt": {"id": "pmpt_1"}}
    gateway.reset()
    with sdk(gateway, SHORT_KEY) as client, pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="mock-llm", input="Hi", extra_body=stored)
    assert refused.value.code == "unsupported_parameter"
    assert refused.value.param == "prompt"
    assert "limit of 60 input tokens" in refused.value.message
    assert gateway.stats()["requests_total"] == 0
    with sdk(gateway) as client:
        answer = client.responses.create(model="mock-llm", input="Hi", extra_body=stored)
    assert answer.status == "completed"
    assert gateway.stats()["requests_total"] == 1


def test_a_response_the_backend_did_not_store_cannot_be_continued(gateway: AgentGateway) -> None:
    """A response made with `store: false` (mock-backend then stores nothing, as OpenAI does):
    nothing to continue, so the gateway answers the 404 itself and asks the backend nothing; a
    stored one is continued. (A backend answering `store: false` on its own, as vLLM does with
    its store off: tests/web/test_stored_state.py.)"""
    with sdk(gateway) as client:
        made = client.responses.create(model="mock-llm", input="Hi", store=False)
        assert made.store is False
        stored = client.responses.create(model="mock-llm", input="Hi")
        gateway.reset()
        with pytest.raises(openai.NotFoundError) as refused:
            client.responses.create(model="mock-llm", input="Hi", previous_response_id=made.id)
        assert refused.value.code == "previous_response_not_found"
        assert gateway.stats()["requests_total"] == 0
        then = client.responses.create(model="mock-llm", input="Hi", previous_response_id=stored.id)
    assert then.previous_response_id == stored.id
    assert gateway.stats()["requests_total"] == 1


def test_a_function_call_output_object_counts_toward_the_input_limit(
    gateway: AgentGateway,
) -> None:
    """A tool's output sent as an object (not a string or content parts), which a backend
    renders as its JSON, counted nothing: any input went past max_input_tokens."""
    gateway.reset()
    call = {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"}
    found = {"type": "function_call_output", "call_id": "c1", "output": {"found": "word " * 200}}
    with sdk(gateway, SHORT_KEY) as client, pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="mock-llm", input=[call, found])  # type: ignore[list-item]
    assert refused.value.code == "context_length_exceeded"
    assert gateway.stats()["requests_total"] == 0


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"input": "Hi", "chat_template": "{{ 'word ' * 500 }}"}, "chat_template"),
        ({"input": "Hi", "previous_input_messages": [{"role": "user"}]}, "previous_input_messages"),
    ],
)
def test_input_the_gateway_cannot_count_is_refused_under_an_input_limit(
    gateway: AgentGateway, extra: dict[str, object], param: str
) -> None:
    """A request's own chat template, vLLM's earlier turns in its own form: the backend reads
    input the gateway never counts. They reached the backend under a 60-token limit; the chat
    route refuses its own template so. (A stored item named by its id is refused for every key:
    tests/web/test_stored_state.py.)"""
    gateway.reset()
    with sdk(gateway, SHORT_KEY) as client, pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="mock-llm", input="", extra_body=extra)
    assert refused.value.code == "unsupported_parameter"
    assert refused.value.param == param
    assert "limit of 60 input tokens" in refused.value.message
    assert gateway.stats()["requests_total"] == 0


def test_a_background_response_is_refused_before_the_backend(gateway: AgentGateway) -> None:
    """A background response is answered `queued` at once and generated afterwards, past the
    request's end: its output would be billed 0 and held by no quota or concurrency slot (and
    GET /v1/responses/{id} is not served here to read it)."""
    gateway.reset()
    with sdk(gateway) as client, pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="mock-llm", input="Hi", background=True, store=True)
    assert (refused.value.code, refused.value.param) == ("unsupported_parameter", "background")
    assert gateway.stats()["requests_total"] == 0
    with sdk(gateway) as client:
        answer = client.responses.create(model="mock-llm", input="Hi", background=False)
    assert answer.status == "completed"


def test_responses_bypass_the_cache_even_where_it_is_on(gateway: AgentGateway) -> None:
    gateway.reset()
    with sdk(gateway, CACHED_KEY) as client:
        for _ in range(2):
            raw = client.responses.with_raw_response.create(
                model="mock-llm", input=QUESTION, temperature=0
            )
            assert raw.headers["x-tokenweir-cache"] == "bypass"
    assert gateway.stats()["requests_total"] == 2


def test_ttft_and_inter_token_gaps_are_metered_on_the_text_deltas(
    gateway: AgentGateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    with sdk(gateway) as client:
        # 200 tokens take 200 ms: they come in many reads even on a loaded machine, and a gap is
        # measured between two of the gateway's writes (30 tokens, 30 ms, fit in one stall).
        stream = client.responses.create(
            model="mock-llm", input=QUESTION, stream=True,
            extra_body={"mock_completion_tokens": 200},
        )  # fmt: skip
        request_id = stream.response.headers["x-request-id"]
        assert sum(event.type == "response.output_text.delta" for event in stream) == 200
    gateway.record(request_id)  # settled: the access line is written
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "tokenweir.access"]
    line = next(line for line in lines if line["request_id"] == request_id)
    assert line["operation"] == "responses"
    assert line["completed"] is True
    assert line["ttft_ms"] is not None
    assert line["itl_p50_ms"] is not None  # gaps between the writes of the deltas
    assert line["ttft_ms"] >= line["upstream_ttft_ms"]


def test_a_response_is_attributed_to_its_user_key_and_tags(gateway: AgentGateway) -> None:
    with sdk(gateway) as client:
        raw = client.responses.with_raw_response.create(
            model="mock-llm",
            input=QUESTION,
            user="bob",
            metadata={"feature": "search", "note": "not a tag, passed through"},
            extra_headers={"x-tokenweir-tags": "agents"},
        )
    record = gateway.record(raw.headers["x-request-id"])
    assert (record.user, record.tags) == ("bob", ("agents", "search"))
    assert str(record.key_id).startswith("sha256:")
