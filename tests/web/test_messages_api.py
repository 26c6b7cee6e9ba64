"""`POST /v1/messages` and `/v1/messages/count_tokens` through the gateway, with the real
anthropic SDK, over the real mock backend: Anthropic's key header, usage, errors and stream."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import orjson
import pytest

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from proxy.tokens import load_counter
from tests.servers import serve
from tests.web.agentgateway import (
    CAPPED_KEY,
    COUNTING_KEY,
    LIMITED_KEY,
    OPEN_KEY,
    OUTPUT_CAP,
    POOR_KEY,
    PRICE_IN_NUSD_PER_TOKEN,
    PRICE_OUT_NUSD_PER_TOKEN,
    SHORT_KEY,
    SYSTEM_PROMPT,
    AgentGateway,
    agent_gateway,
    qwen_spec,
    wait_for_stat,
)

HELLO = [{"role": "user", "content": "Name three rivers of Europe."}]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentGateway]:
    with agent_gateway(Path(tmp_path_factory.mktemp("messages"))) as running:
        yield running


def sdk(gateway: AgentGateway, key: str = OPEN_KEY) -> anthropic.Anthropic:
    """The SDK as Anthropic's users run it: the key goes in `x-api-key`."""
    return anthropic.Anthropic(base_url=gateway.url, api_key=key, max_retries=0)


def test_a_whole_message_is_billed_from_its_usage(gateway: AgentGateway) -> None:
    with sdk(gateway) as client:
        raw = client.messages.with_raw_response.create(
            model="mock-llm",
            max_tokens=100,
            messages=HELLO,
            extra_body={"mock_completion_tokens": 7},
        )
    message = raw.parse()
    assert message.stop_reason == "end_turn"
    assert message.content[0].type == "text"
    assert len(message.content[0].text.split()) == 7
    assert (message.usage.input_tokens, message.usage.output_tokens) == (5 + 4, 7)
    record = gateway.record(raw.headers["x-request-id"])
    assert (record.operation, record.status, record.stream) == ("messages", 200, False)
    assert (record.input_tokens, record.output_tokens) == (9, 7)
    assert record.usage_source == "backend"
    assert record.cost_nusd == 9 * PRICE_IN_NUSD_PER_TOKEN + 7 * PRICE_OUT_NUSD_PER_TOKEN


def test_a_streamed_message_is_billed_from_message_start_and_message_delta(
    gateway: AgentGateway,
) -> None:
    with (
        sdk(gateway) as client,
        client.messages.stream(
            model="mock-llm",
            max_tokens=100,
            messages=HELLO,
            extra_body={"mock_completion_tokens": 12},
        ) as stream,
    ):
        request_id = stream.response.headers["x-request-id"]
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(texts) == 12
    assert final.content[0].type == "text"
    assert final.content[0].text == "".join(texts)
    assert (final.usage.input_tokens, final.usage.output_tokens) == (9, 12)
    record = gateway.record(request_id)
    assert (record.operation, record.stream, record.status) == ("messages", True, 200)
    assert (record.input_tokens, record.output_tokens) == (9, 12)
    assert record.usage_source == "backend"
    assert record.ttft_ms is not None  # metered on the first content_block_delta
    # A speed needs two reads with text: on a loaded machine the whole stream may arrive in one
    # read (first token = last token), and the speed is then unknown, not made up.
    assert record.tokens_per_s is None or record.tokens_per_s > 0


def test_the_raw_event_sequence_is_anthropics(gateway: AgentGateway) -> None:
    with sdk(gateway) as client:
        events = list(
            client.messages.create(
                model="mock-llm",
                max_tokens=100,
                messages=HELLO,
                stream=True,
                extra_body={"mock_completion_tokens": 3},
            )
        )
    assert [event.type for event in events] == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 3,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]  # the SDK skips `ping`


def test_a_bearer_key_works_too_and_a_wrong_key_is_an_anthropic_401(
    gateway: AgentGateway,
) -> None:
    with anthropic.Anthropic(base_url=gateway.url, auth_token=OPEN_KEY, max_retries=0) as bearer:
        message = bearer.messages.create(model="mock-llm", max_tokens=5, messages=HELLO)
    assert message.usage.output_tokens == 5
    with sdk(gateway, "tw-wrong") as client, pytest.raises(anthropic.AuthenticationError) as bad:
        client.messages.create(model="mock-llm", max_tokens=5, messages=HELLO)
    assert bad.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "Incorrect API key provided."},
    }
    missing = httpx.post(
        gateway.url + "/v1/messages",
        json={"model": "mock-llm", "max_tokens": 5, "messages": HELLO},
        timeout=10,
    )
    assert missing.status_code == 401
    assert missing.json()["error"]["type"] == "authentication_error"


def test_the_output_cap_and_system_prompt_apply(gateway: AgentGateway) -> None:
    with sdk(gateway, CAPPED_KEY) as client:
        raw = client.messages.with_raw_response.create(
            model="mock-llm", max_tokens=100, system="Be kind.", messages=HELLO
        )
    message = raw.parse()
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == OUTPUT_CAP
    sent = gateway.stats()["last_request"]
    assert isinstance(sent, dict)
    assert sent["max_tokens"] == OUTPUT_CAP
    assert sent["system"] == f"{SYSTEM_PROMPT}\n\nBe kind."
    assert set(raw.headers["x-tokenweir-shaped"].split(",")) == {"system_prompt", "max_tokens"}


@pytest.mark.parametrize("kind", ["document", None])
def test_the_system_prompt_is_not_taken_as_given_in_a_block_that_is_not_text(
    gateway: AgentGateway, kind: str | None
) -> None:
    """A first system block with the prompt's text but another type (or none) was taken as the
    tenant's prompt already in place; vLLM reads only text blocks, so the prompt was left out."""
    block = {"text": SYSTEM_PROMPT} if kind is None else {"type": kind, "text": SYSTEM_PROMPT}
    with sdk(gateway, CAPPED_KEY) as client:
        raw = client.messages.with_raw_response.create(
            model="mock-llm",
            max_tokens=5,
            system=[block],
            messages=HELLO,  # type: ignore[list-item]
        )
    sent = gateway.stats()["last_request"]
    assert isinstance(sent, dict)
    assert sent["system"] == [{"type": "text", "text": SYSTEM_PROMPT}, block]
    assert "system_prompt" in raw.headers["x-tokenweir-shaped"].split(",")


def test_over_quota_is_an_anthropic_429_that_bills_nothing(gateway: AgentGateway) -> None:
    gateway.reset()
    with sdk(gateway, POOR_KEY) as client, pytest.raises(anthropic.RateLimitError) as refused:
        client.messages.create(model="mock-llm", max_tokens=100, messages=HELLO)
    body = refused.value.body
    assert isinstance(body, dict)
    assert body["type"] == "error"
    assert body["error"]["type"] == "rate_limit_error"
    assert "tokens_per_day" in body["error"]["message"]
    answer = refused.value.response
    assert answer.headers["x-should-retry"] == "false"
    record = gateway.record(answer.headers["x-request-id"])
    assert (record.status, record.input_tokens, record.output_tokens, record.cost_nusd) == (
        429,
        0,
        0,
        0,
    )
    assert gateway.stats()["requests_total"] == 0


@pytest.mark.parametrize(
    ("body", "status", "kind"),
    [
        ({"model": "mock-llm", "max_tokens": 5, "messages": []}, 400, "invalid_request_error"),
        ({"model": "mock-llm", "messages": HELLO}, 400, "invalid_request_error"),
        (
            {"model": "mock-llm", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]},
            400,
            "invalid_request_error",
        ),
        (
            {"model": "mock-llm", "max_tokens": 5, "messages": HELLO, "temperature": 1.5},
            400,
            "invalid_request_error",
        ),
        ({"model": "mock-small", "max_tokens": 5, "messages": HELLO}, 403, "permission_error"),
        ({"model": "no-such-model", "max_tokens": 5, "messages": HELLO}, 404, "not_found_error"),
        (b"{not json", 400, "invalid_request_error"),
    ],
)
def test_bad_requests_get_anthropics_error_shape_and_reach_no_backend(
    gateway: AgentGateway, body: dict[str, object] | bytes, status: int, kind: str
) -> None:
    gateway.reset()
    content = body if isinstance(body, bytes) else None
    answer = httpx.post(
        gateway.url + "/v1/messages",
        content=content,
        json=None if content is not None else body,
        headers={"x-api-key": OPEN_KEY, "content-type": "application/json"},
        timeout=10,
    )
    assert answer.status_code == status
    error = answer.json()
    assert set(error) == {"type", "error"}
    assert error["type"] == "error"
    assert error["error"]["type"] == kind
    assert isinstance(error["error"]["message"], str)
    assert error["error"]["message"]
    assert answer.headers["content-length"] == str(len(answer.content))
    assert gateway.stats()["requests_total"] == 0


def test_a_wrong_route_or_method_under_messages_is_an_anthropic_error(
    gateway: AgentGateway,
) -> None:
    """A 404 or 405 the router gives on the Messages routes (the batches API, a GET) was
    OpenAI-shaped: the anthropic SDK's error then had no Anthropic type."""
    with sdk(gateway) as client, pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.batches.list()
    assert missing.value.body == {
        "type": "error",
        "error": {
            "type": "not_found_error",
            "message": "Unknown request URL: GET /v1/messages/batches.",
        },
    }
    answer = httpx.get(gateway.url + "/v1/messages", headers={"x-api-key": OPEN_KEY}, timeout=10)
    assert answer.status_code == 405
    assert answer.json() == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "GET is not allowed on /v1/messages.",
        },
    }


def test_an_unexpected_error_is_an_anthropic_500(tmp_path: Path) -> None:
    """An error no stage caught is answered by the app's handler, past the Messages route's
    own wrapper: it was OpenAI-shaped there."""

    class Broken(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            raise RuntimeError("a bug below the relay")

    policy = parse_policy(
        f"""
backends: [{{name: b, url: "http://127.0.0.1:9/v1", models: [m]}}]
models: {{m: {{}}}}
tenants: {{t: {{api_keys: [{hash_key(OPEN_KEY)}], models: [m]}}}}
""",
        file="broken.yaml",
        environ={},
    )
    with (
        serve(create_app(policy, transport=Broken())) as url,
        anthropic.Anthropic(base_url=url, api_key=OPEN_KEY, max_retries=0) as client,
        pytest.raises(anthropic.InternalServerError) as caught,
    ):
        client.messages.create(model="m", max_tokens=5, messages=HELLO)
    assert caught.value.status_code == 500
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "api_error"


def test_a_client_that_leaves_cancels_the_backend(gateway: AgentGateway) -> None:
    gateway.reset()
    with (
        sdk(gateway) as client,
        client.messages.stream(
            model="mock-llm",
            max_tokens=20_000,
            messages=HELLO,
            extra_body={"mock_completion_tokens": 20_000},
        ) as stream,
    ):
        request_id = stream.response.headers["x-request-id"]
        for seen, _ in enumerate(stream.text_stream, start=1):
            if seen == 20:
                break
    wait_for_stat(gateway, "streams_cancelled", 1)
    assert gateway.stats()["streams_completed"] == 0
    record = gateway.record(request_id)
    assert record.client_disconnected is True
    assert 20 <= record.output_tokens < 20_000


def test_a_backend_dying_mid_stream_is_an_error_event_the_sdk_raises(
    gateway: AgentGateway,
) -> None:
    knobs = {"mock_completion_tokens": 50, "mock_fail_after_tokens": 5}
    with sdk(gateway) as client, pytest.raises(anthropic.APIStatusError) as failed:
        for _ in client.messages.create(
            model="mock-llm", max_tokens=100, messages=HELLO, stream=True, extra_body=knobs
        ):
            pass
    body = failed.value.body
    assert isinstance(body, dict)
    assert body["type"] == "error"
    assert body["error"]["type"] == "api_error"


def test_count_tokens_is_the_models_tokenizer_and_bills_nothing(gateway: AgentGateway) -> None:
    gateway.reset()
    counter = load_counter(qwen_spec(), model="mock-llm")
    system = "You are terse."
    with sdk(gateway) as client:
        counted = client.messages.count_tokens(model="mock-llm", system=system, messages=HELLO)
    expected = counter.count_chat([{"role": "system", "content": system}, *HELLO])
    assert counted.input_tokens == expected
    with sdk(gateway, CAPPED_KEY) as client:
        capped = client.messages.count_tokens(model="mock-llm", messages=HELLO)
    # The tenant's system prompt goes into every real request, so it is counted too.
    assert capped.input_tokens == counter.count_chat(
        [{"role": "system", "content": SYSTEM_PROMPT}, *HELLO]
    )
    assert gateway.stats()["requests_total"] == 0
    with sdk(gateway) as client, pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.count_tokens(model="mock-llm", messages=[])
    assert isinstance(bad.value.body, dict)
    assert bad.value.body["error"]["type"] == "invalid_request_error"


def test_count_tokens_takes_a_request_from_the_tenants_requests_per_minute(
    gateway: AgentGateway,
) -> None:
    """A tenant at its limit cannot keep the gateway tokenizing bodies of up to
    max_body_bytes: each count is one request of its requests_per_minute."""
    gateway.reset()
    with sdk(gateway, COUNTING_KEY) as client:
        counts = [client.messages.count_tokens(model="mock-llm", messages=HELLO) for _ in "ab"]
        assert [c.input_tokens for c in counts] == [counts[0].input_tokens] * 2
        with pytest.raises(anthropic.RateLimitError) as refused:
            client.messages.count_tokens(model="mock-llm", messages=HELLO)
        with pytest.raises(anthropic.RateLimitError):  # the counts took the minute's requests
            client.messages.create(model="mock-llm", max_tokens=5, messages=HELLO)
    body = refused.value.body
    assert isinstance(body, dict)
    assert body["error"]["type"] == "rate_limit_error"
    assert "requests_per_minute" in body["error"]["message"]
    assert 1 <= int(refused.value.response.headers["retry-after"]) <= 60
    assert gateway.stats()["requests_total"] == 0


def test_an_input_over_the_limit_is_an_anthropic_400(gateway: AgentGateway) -> None:
    gateway.reset()
    long_messages = [{"role": "user", "content": "word " * 100}]
    with sdk(gateway, SHORT_KEY) as client, pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="mock-llm", max_tokens=5, messages=long_messages)
    assert isinstance(refused.value.body, dict)
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert "over this key's limit of 60 input tokens" in refused.value.body["error"]["message"]
    assert gateway.stats()["requests_total"] == 0


def test_a_backends_own_error_reaches_the_client_in_anthropics_shape(
    gateway: AgentGateway,
) -> None:
    with sdk(gateway) as client, pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(
            model="mock-llm", max_tokens=5, messages=HELLO, extra_body={"mock_fail": 400}
        )
    assert refused.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "Simulated failure (mock_fail=400)."},
    }


def test_a_rate_limit_is_an_anthropic_429_with_retry_after(gateway: AgentGateway) -> None:
    with sdk(gateway, LIMITED_KEY) as client:
        first = client.messages.with_raw_response.create(
            model="mock-llm", max_tokens=5, messages=HELLO
        )
        assert first.headers["x-ratelimit-limit-requests"] == "1"
        with pytest.raises(anthropic.RateLimitError) as limited:
            client.messages.create(model="mock-llm", max_tokens=5, messages=HELLO)
    body = limited.value.body
    assert isinstance(body, dict)
    assert body["error"]["type"] == "rate_limit_error"
    headers = limited.value.response.headers
    assert 1 <= int(headers["retry-after"]) <= 60
    assert headers["x-ratelimit-remaining-requests"] == "0"


def test_a_client_that_leaves_a_whole_message_cancels_the_backend(gateway: AgentGateway) -> None:
    gateway.reset()
    body = orjson.dumps(
        {
            "model": "mock-llm",
            "max_tokens": 20_000,
            "messages": HELLO,
            "mock_completion_tokens": 20_000,  # 20 s of generation before the answer
        }
    )
    host, port = gateway.url.removeprefix("http://").split(":")
    head = (
        f"POST /v1/messages HTTP/1.1\r\nhost: {host}\r\nx-api-key: {OPEN_KEY}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=10) as client:
        client.sendall(head.encode() + body)
        wait_for_stat(gateway, "inflight", 1)  # the backend is generating
    wait_for_stat(gateway, "requests_cancelled", 1)  # and stops once the client has gone
    assert gateway.stats()["inflight"] == 0


def test_metadata_user_id_is_the_end_user_and_the_tags_header_tags(gateway: AgentGateway) -> None:
    with sdk(gateway) as client:
        raw = client.messages.with_raw_response.create(
            model="mock-llm",
            max_tokens=20,
            messages=HELLO,
            metadata={"user_id": "ann-42"},
            extra_headers={"x-tokenweir-tags": "agents,beta"},
        )
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.messages.create(
                model="mock-llm",
                max_tokens=20,
                messages=HELLO,
                metadata={"user_id": "u" * 200},
            )
    record = gateway.record(raw.headers["x-request-id"])
    assert (record.user, record.tags) == ("ann-42", ("agents", "beta"))  # user_id is no tag
    assert "metadata.user_id" in refused.value.message


@pytest.mark.parametrize("user_id", [42, ["ann"], {"id": "ann"}, True])
def test_a_user_id_that_is_no_string_is_an_anthropic_400(
    gateway: AgentGateway, user_id: object
) -> None:
    """It passed to the backend and the request went unattributed (no user in the ledger)."""
    gateway.reset()
    answer = httpx.post(
        gateway.url + "/v1/messages",
        json={
            "model": "mock-llm",
            "max_tokens": 5,
            "messages": HELLO,
            "metadata": {"user_id": user_id},
        },
        headers={"x-api-key": OPEN_KEY},
        timeout=10,
    )
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "'metadata.user_id'" in error["message"]
    assert gateway.stats()["requests_total"] == 0


def _sent_with_thinking(gateway: AgentGateway, key: str, thinking: dict[str, object]) -> dict:
    with sdk(gateway, key) as client:
        client.messages.create(
            model="mock-llm",
            max_tokens=4000,
            messages=HELLO,
            thinking=thinking,  # type: ignore[arg-type]
        )
    sent = gateway.stats()["last_request"]
    assert isinstance(sent, dict)
    return sent


def test_extended_thinking_is_left_out_below_the_least_budget_the_bound_leaves(
    gateway: AgentGateway,
) -> None:
    """Anthropic refuses `thinking.budget_tokens` at or above `max_tokens`: a request the client
    wrote correctly (a budget of 2,048 under 4,000) was sent with the tenant's bound of 3 and the
    budget as given, which the backend refused. A bound under 1,025 leaves no room for the least
    budget (1,024): thinking is left out. (tests/test_outgoing.py: a bound above it.)"""
    thinking: dict[str, object] = {"type": "enabled", "budget_tokens": 2048}
    sent = _sent_with_thinking(gateway, CAPPED_KEY, thinking)
    assert sent["max_tokens"] == OUTPUT_CAP
    assert "thinking" not in sent
    sent = _sent_with_thinking(gateway, OPEN_KEY, thinking)  # no bound of the gateway's
    assert (sent["max_tokens"], sent["thinking"]) == (4000, thinking)
