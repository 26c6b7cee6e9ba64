"""The mock backend's tool calls on the Responses and Messages APIs, read by the real openai and
anthropic SDKs: function_call items and tool_use blocks, whole and streamed, by tool_choice."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from anthropic.types import MessageParam, ToolParam
from openai.types.responses import FunctionToolParam, ResponseInputParam

from proxy.tools.mock.backend import create_app
from proxy.tools.mock.toolcalls import PIECE_CHARS
from tests.servers import serve
from tests.tools.test_mock_toolcalls import TOOLS as CHAT_TOOLS
from tests.web.agentgateway import OPEN_KEY, agent_gateway

WEATHER_SCHEMA: dict[str, Any] = dict(CHAT_TOOLS[0]["function"].get("parameters", {}))
MAIL_SCHEMA: dict[str, Any] = {"type": "object", "properties": {"to": {"type": "string"}}}
FUNCTIONS: list[FunctionToolParam] = [
    {"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA, "strict": False},
    {"type": "function", "name": "send_mail", "parameters": MAIL_SCHEMA, "strict": False},
]
TOOLS: list[ToolParam] = [
    {"name": "get_weather", "input_schema": WEATHER_SCHEMA},
    {"name": "send_mail", "input_schema": MAIL_SCHEMA},
]
QUESTION = "weather in Paris?"
ASK: list[MessageParam] = [{"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def clients() -> Iterator[tuple[openai.OpenAI, anthropic.Anthropic]]:
    """Both SDKs on one mock, unpaced."""
    with (
        serve(create_app(ttft_ms=0, tokens_per_second=math.inf)) as url,
        openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as oai,
        anthropic.Anthropic(base_url=url, api_key="x", max_retries=0) as claude,
    ):
        yield oai, claude


@pytest.fixture
def oai(clients: tuple[openai.OpenAI, anthropic.Anthropic]) -> openai.OpenAI:
    return clients[0]


@pytest.fixture
def claude(clients: tuple[openai.OpenAI, anthropic.Anthropic]) -> anthropic.Anthropic:
    return clients[1]


def fits_the_weather_schema(arguments: dict[str, Any]) -> None:
    assert list(arguments) == ["city", "days", "unit", "detailed"]
    assert isinstance(arguments["city"], str)
    assert arguments["city"]
    assert type(arguments["days"]) is int
    assert arguments["unit"] == "celsius"
    assert arguments["detailed"] is True


def pieces(text: str) -> int:
    return math.ceil(len(text) / PIECE_CHARS)


def test_a_response_to_a_question_holds_a_function_call_item(oai: openai.OpenAI) -> None:
    response = oai.responses.create(model="m", input=QUESTION, tools=FUNCTIONS)
    assert response.status == "completed"
    (call,) = response.output
    assert call.type == "function_call"
    assert call.name == "get_weather"  # the first function tool
    assert call.call_id.startswith("call_")
    assert call.id is not None
    assert call.id.startswith("fc_")
    assert call.status == "completed"
    fits_the_weather_schema(json.loads(call.arguments))
    assert response.output_text == ""
    assert response.usage is not None
    assert response.usage.output_tokens == pieces(call.arguments)
    assert [tool.name for tool in response.tools if tool.type == "function"] == [
        "get_weather", "send_mail",
    ]  # fmt: skip


def test_a_response_stream_carries_each_call_in_openais_events(oai: openai.OpenAI) -> None:
    whole = oai.responses.create(model="m", input=QUESTION, tools=FUNCTIONS)
    with oai.responses.stream(
        model="m", input=QUESTION, tools=FUNCTIONS, extra_body={"mock_tool_calls": 2}
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    first, second = (e for e in events if e.type == "response.output_item.done")
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    n0 = sum(1 for e in deltas if e.output_index == 0)
    n1 = len(deltas) - n0
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * n0,
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * n1,
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    (expected,) = whole.output
    assert expected.type == "function_call"
    assert first.item.type == second.item.type == "function_call"
    assert (first.item.name, first.item.arguments) == ("get_weather", expected.arguments)
    assert second.item.name == "send_mail"
    assert json.loads(second.item.arguments).keys() == {"to"}
    assert first.item.call_id != second.item.call_id
    assert "".join(e.delta for e in deltas[:n0]) == first.item.arguments
    assert {e.item_id for e in deltas[:n0]} == {first.item.id}
    fields = ("id", "call_id", "name", "arguments", "status")
    assert [[getattr(item, f) for f in fields] for item in final.output] == [
        [getattr(first.item, f) for f in fields], [getattr(second.item, f) for f in fields],
    ]  # fmt: skip
    assert final.usage is not None
    assert final.usage.output_tokens == len(deltas)


def test_a_response_calls_by_tool_choice_and_answers_a_tools_output(oai: openai.OpenAI) -> None:
    after: ResponseInputParam = [
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    text = oai.responses.create(model="m", input=after, tools=FUNCTIONS)
    assert [item.type for item in text.output] == ["message"]
    assert text.output_text
    again = oai.responses.create(model="m", input=after, tools=FUNCTIONS, tool_choice="required")
    assert [item.type for item in again.output] == ["function_call"]
    none = oai.responses.create(model="m", input=QUESTION, tools=FUNCTIONS, tool_choice="none")
    assert [item.type for item in none.output] == ["message"]
    named = oai.responses.create(
        model="m", input=QUESTION, tools=FUNCTIONS,
        tool_choice={"type": "function", "name": "send_mail"},
    )  # fmt: skip
    assert [getattr(item, "name", None) for item in named.output] == ["send_mail"]
    with pytest.raises(openai.BadRequestError, match="not among 'tools'"):
        oai.responses.create(
            model="m", input=QUESTION, tools=FUNCTIONS,
            tool_choice={"type": "function", "name": "delete_all"},
        )  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="parallel_tool_calls"):
        oai.responses.create(
            model="m", input=QUESTION, tools=FUNCTIONS, parallel_tool_calls=False,
            extra_body={"mock_tool_calls": 2},
        )  # fmt: skip


def test_max_output_tokens_leaves_a_call_incomplete(oai: openai.OpenAI) -> None:
    response = oai.responses.create(model="m", input=QUESTION, tools=FUNCTIONS, max_output_tokens=3)
    assert response.status == "incomplete"
    (call,) = response.output
    assert call.type == "function_call"
    assert call.status == "incomplete"
    assert len(call.arguments) == 3 * PIECE_CHARS
    with oai.responses.stream(
        model="m", input=QUESTION, tools=FUNCTIONS, max_output_tokens=3
    ) as stream:
        events = list(stream)
    assert [e.type for e in events][-2:] == ["response.output_item.done", "response.incomplete"]
    assert [e.response.status for e in events if e.type == "response.created"] == ["in_progress"]
    done = events[-2]
    assert done.type == "response.output_item.done"
    assert done.item.status == "incomplete"


def test_a_message_to_a_question_holds_a_tool_use_block(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(model="m", max_tokens=500, messages=ASK, tools=TOOLS)
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert block.type == "tool_use"
    assert block.id.startswith("toolu_")
    assert block.name == "get_weather"
    assert isinstance(block.input, dict)
    fits_the_weather_schema(block.input)
    assert message.usage.output_tokens == pieces(json.dumps(block.input, separators=(",", ":")))


def test_a_message_stream_carries_each_call_as_anthropic_sends_it(
    claude: anthropic.Anthropic,
) -> None:
    whole = claude.messages.create(model="m", max_tokens=500, messages=ASK, tools=TOOLS)
    with claude.messages.stream(
        model="m", max_tokens=500, messages=ASK, tools=TOOLS, extra_body={"mock_tool_calls": 3}
    ) as stream:
        events = [e for e in stream if e.type not in ("input_json", "text")]  # SDK's own events
        final = stream.get_final_message()
    kinds = [(e.type, getattr(e, "index", None)) for e in events]
    opened = [
        (e.index, e.content_block.type, e.content_block.input)
        for e in events
        if e.type == "content_block_start"
    ]
    assert opened == [(0, "tool_use", {}), (1, "tool_use", {}), (2, "tool_use", {})]
    assert kinds[:2] == [("message_start", None), ("content_block_start", 0)]  # ping: not shown
    assert kinds[-2:] == [("message_delta", None), ("message_stop", None)]
    for index in range(3):  # each block's deltas between its start and its stop
        at = kinds.index(("content_block_start", index))
        stop = kinds.index(("content_block_stop", index))
        assert set(kinds[at + 1 : stop]) == {("content_block_delta", index)}
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert {e.delta.type for e in deltas} == {"input_json_delta"}
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["tool_use"] * 3
    assert [getattr(b, "name", None) for b in final.content] == [
        "get_weather", "send_mail", "get_weather",
    ]  # fmt: skip
    first = final.content[0]
    assert first.type == whole.content[0].type == "tool_use"
    assert first.input == getattr(whole.content[0], "input", None)
    assert len({getattr(b, "id", None) for b in final.content}) == 3
    assert final.usage.output_tokens == len(deltas)


def test_a_message_calls_by_tool_choice_and_answers_a_tool_result(
    claude: anthropic.Anthropic,
) -> None:
    after: list[MessageParam] = [
        *ASK,
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}],
        },
    ]
    ask: dict[str, Any] = {"model": "m", "max_tokens": 500, "tools": TOOLS}
    text = claude.messages.create(**ask, messages=after)
    assert (text.stop_reason, [b.type for b in text.content]) == ("end_turn", ["text"])
    again = claude.messages.create(**ask, messages=after, tool_choice={"type": "any"})
    assert (again.stop_reason, [b.type for b in again.content]) == ("tool_use", ["tool_use"])
    none = claude.messages.create(**ask, messages=ASK, tool_choice={"type": "none"})
    assert [b.type for b in none.content] == ["text"]
    named = claude.messages.create(
        **ask, messages=ASK, tool_choice={"type": "tool", "name": "send_mail"}
    )
    assert [getattr(b, "name", None) for b in named.content] == ["send_mail"]
    with pytest.raises(anthropic.BadRequestError, match="not among 'tools'"):
        claude.messages.create(
            **ask, messages=ASK, tool_choice={"type": "tool", "name": "delete_all"}
        )
    with pytest.raises(anthropic.BadRequestError, match="disable_parallel_tool_use"):
        claude.messages.create(
            **ask, messages=ASK,
            tool_choice={"type": "auto", "disable_parallel_tool_use": True},
            extra_body={"mock_tool_calls": 2},
        )  # fmt: skip


def test_max_tokens_cuts_a_tool_use_to_its_whole_properties(
    claude: anthropic.Anthropic,
) -> None:
    whole = claude.messages.create(model="m", max_tokens=500, messages=ASK, tools=TOOLS)
    full = getattr(whole.content[0], "input", None)
    assert isinstance(full, dict)
    cut = claude.messages.create(model="m", max_tokens=6, messages=ASK, tools=TOOLS)
    assert cut.stop_reason == "max_tokens"
    assert cut.usage.output_tokens == 6
    (block,) = cut.content
    assert block.type == "tool_use"
    assert block.input
    assert block.input.items() < full.items()
    sent = json.dumps(full, separators=(",", ":"))[: 6 * PIECE_CHARS]
    assert sent.startswith(json.dumps(block.input, separators=(",", ":"))[:-1])
    with claude.messages.stream(model="m", max_tokens=6, messages=ASK, tools=TOOLS) as stream:
        streamed = stream.get_final_message()  # the SDK reads the cut JSON as far as it goes
    assert streamed.stop_reason == "max_tokens"
    assert [getattr(b, "input", None) for b in streamed.content] == [block.input]


def test_streamed_calls_through_the_gateway_are_billed_from_their_usage(tmp_path: Path) -> None:
    """Both APIs' tool-call streams through a real gateway (ledger on) reach the client whole,
    and each record holds the backend's output tokens, one a piece of the arguments."""
    with agent_gateway(tmp_path) as gateway:
        with (
            anthropic.Anthropic(base_url=gateway.url, api_key=OPEN_KEY, max_retries=0) as claude,
            claude.messages.with_streaming_response.create(
                model="mock-llm", max_tokens=500, messages=ASK, tools=TOOLS, stream=True
            ) as raw,
        ):
            message_id = raw.headers["x-request-id"]
            kinds = [line for line in raw.iter_lines() if line.startswith("event: ")]
        with (
            openai.OpenAI(base_url=gateway.url + "/v1", api_key=OPEN_KEY, max_retries=0) as oai,
            oai.responses.with_streaming_response.create(
                model="mock-llm", input=QUESTION, tools=FUNCTIONS, stream=True
            ) as raw_response,
        ):
            response_id = raw_response.headers["x-request-id"]
            lines = [line for line in raw_response.iter_lines() if line.startswith("data: ")]
        message_record = gateway.record(message_id)
        response_record = gateway.record(response_id)
    deltas = kinds.count("event: content_block_delta")
    assert kinds[-2:] == ["event: message_delta", "event: message_stop"]
    assert (message_record.status, message_record.stream) == (200, True)
    assert message_record.output_tokens == deltas
    assert message_record.usage_source == "backend"
    events = [json.loads(line[6:]) for line in lines]
    arguments = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][0]["type"] == "function_call"
    assert response_record.output_tokens == len(arguments)
    assert response_record.usage_source == "backend"
