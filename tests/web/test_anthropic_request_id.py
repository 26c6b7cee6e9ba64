"""Anthropic's SDK finds each answer's request id where Anthropic puts it, `request-id`: in a
message's `_request_id`, a stream's headers and an error's `request_id` and message."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest

from tests.web.agentgateway import OPEN_KEY, AgentGateway, agent_gateway

HELLO = [{"role": "user", "content": "Name three rivers of Europe."}]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentGateway]:
    with agent_gateway(Path(tmp_path_factory.mktemp("request-id"))) as running:
        yield running


def test_a_message_a_stream_and_a_count_carry_the_gateways_request_id(
    gateway: AgentGateway,
) -> None:
    """The gateway's id went only as `x-request-id`, which Anthropic's SDK does not read: a
    message's `_request_id` was None through the gateway."""
    with anthropic.Anthropic(base_url=gateway.url, api_key=OPEN_KEY, max_retries=0) as client:
        raw = client.messages.with_raw_response.create(
            model="mock-llm", max_tokens=5, messages=HELLO
        )
        message = raw.parse()
        with client.messages.stream(model="mock-llm", max_tokens=5, messages=HELLO) as stream:
            streamed = stream.response.headers
            stream.until_done()
        counted = client.messages.with_raw_response.count_tokens(model="mock-llm", messages=HELLO)
        listed = client.models.with_raw_response.list()
    assert message._request_id == raw.headers["x-request-id"]
    assert message._request_id.startswith("req_")
    for headers in (streamed, counted.headers, listed.headers):
        assert headers["request-id"] == headers["x-request-id"]


def test_an_error_names_the_request_id(gateway: AgentGateway) -> None:
    with anthropic.Anthropic(base_url=gateway.url, api_key=OPEN_KEY, max_retries=0) as client:
        with pytest.raises(anthropic.NotFoundError) as missing:
            client.messages.create(model="no-such-model", max_tokens=5, messages=HELLO)
        with pytest.raises(anthropic.AuthenticationError) as wrong:
            client.with_options(api_key="tw-wrong").messages.count_tokens(
                model="mock-llm", messages=HELLO
            )
        with pytest.raises(anthropic.NotFoundError) as no_route:  # the router's own 404
            client.messages.batches.list()
    for error in (missing.value, wrong.value, no_route.value):
        assert error.request_id == error.response.headers["x-request-id"]
        assert f"request_id: {error.request_id}" in str(error)
