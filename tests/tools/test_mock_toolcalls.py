"""The mock backend's tool calls, as the openai SDK sees them, alone and through the gateway."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from proxy.app import create_app as create_gateway
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from proxy.tools.mock.backend import create_app
from proxy.tools.mock.toolcalls import PIECE_CHARS
from tests.servers import serve

TOOLS: list[ChatCompletionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                    "detailed": {"type": "boolean"},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "send_mail", "parameters": {"properties": {"to": {"type": "string"}}}},
    },
]
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def mock_url() -> Iterator[str]:
    with serve(create_app(ttft_ms=0, tokens_per_second=math.inf)) as url:
        yield url


@pytest.fixture
def sdk(mock_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=mock_url + "/v1", api_key="x", max_retries=0) as client:
        yield client


def streamed_calls(stream: Any) -> tuple[list[dict[str, str]], str | None, int | None]:
    """The calls a stream made (assembled by index, as agents do), its finish, its usage."""
    calls: dict[int, dict[str, str]] = {}
    finish, completion_tokens = None, None
    for chunk in stream:
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                call["name"] += (delta.function and delta.function.name) or ""
                call["arguments"] += (delta.function and delta.function.arguments) or ""
    return [calls[i] for i in sorted(calls)], finish, completion_tokens


def test_a_user_question_with_tools_gets_a_call_whose_arguments_fit_the_schema(
    sdk: openai.OpenAI,
) -> None:
    answer = sdk.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function"
    assert call.id.startswith("call_")
    assert call.function.name == "get_weather"  # the first function tool
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments["city"], str)
    assert arguments["city"]
    assert type(arguments["days"]) is int
    assert arguments["unit"] == "celsius"
    assert arguments["detailed"] is True
    pieces = math.ceil(len(call.function.arguments) / PIECE_CHARS)
    assert answer.usage is not None
    assert answer.usage.completion_tokens == pieces


def test_a_stream_carries_the_same_call_in_pieces_and_its_usage(sdk: openai.OpenAI) -> None:
    whole = sdk.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
    stream = sdk.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, stream=True, stream_options={"include_usage": True}
    )
    calls, finish, completion_tokens = streamed_calls(stream)
    (expected,) = whole.choices[0].message.tool_calls or []
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (expected.function.name, expected.function.arguments)
    ]
    assert calls[0]["id"].startswith("call_")
    assert calls[0]["id"] != expected.id
    assert finish == "tool_calls"
    assert whole.usage is not None
    assert completion_tokens == whole.usage.completion_tokens


def test_parallel_calls_go_round_the_tools_each_opened_by_its_own_event(
    sdk: openai.OpenAI,
) -> None:
    stream = sdk.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, stream=True, extra_body={"mock_tool_calls": 3}
    )
    calls, finish, _ = streamed_calls(stream)
    assert [c["name"] for c in calls] == ["get_weather", "send_mail", "get_weather"]
    assert len({c["id"] for c in calls}) == 3
    assert all(json.loads(c["arguments"]) for c in calls)
    assert finish == "tool_calls"
    with pytest.raises(openai.BadRequestError, match="parallel_tool_calls"):
        sdk.chat.completions.create(
            model="m", messages=ASK, tools=TOOLS, parallel_tool_calls=False,
            extra_body={"mock_tool_calls": 2},
        )  # fmt: skip


def test_tool_choice_decides_as_a_model_would(sdk: openai.OpenAI) -> None:
    after_results: list[ChatCompletionMessageParam] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = sdk.chat.completions.create(model="m", messages=after_results, tools=TOOLS)
    assert text.choices[0].finish_reason == "stop"
    assert text.choices[0].message.content
    assert text.choices[0].message.tool_calls is None
    again = sdk.chat.completions.create(
        model="m", messages=after_results, tools=TOOLS, tool_choice="required"
    )
    assert again.choices[0].finish_reason == "tool_calls"
    none = sdk.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="none")
    assert none.choices[0].message.tool_calls is None
    named = sdk.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "send_mail"}},
    )  # fmt: skip
    assert [c.function.name for c in named.choices[0].message.tool_calls or []] == ["send_mail"]
    with pytest.raises(openai.BadRequestError, match="not among 'tools'"):
        sdk.chat.completions.create(
            model="m", messages=ASK, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "delete_all"}},
        )  # fmt: skip


def test_max_tokens_cuts_the_arguments_and_each_choice_has_its_own_ids(
    sdk: openai.OpenAI,
) -> None:
    answer = sdk.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=3, n=2)
    assert [c.finish_reason for c in answer.choices] == ["length", "length"]
    calls = [c.message.tool_calls[0] for c in answer.choices if c.message.tool_calls]
    assert [len(c.function.arguments) for c in calls] == [3 * PIECE_CHARS] * 2
    assert calls[0].id != calls[1].id
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 2 * 3


def test_a_streamed_call_cached_by_the_gateway_is_replayed_whole(mock_url: str) -> None:
    """The mock's calls through the gateway's exact cache: stored from the stream, the same
    request again (whole) gets the same call, and the backend is not asked twice."""
    policy = parse_policy(
        f"""
storage: memory
backends: [{{name: mock, url: "{mock_url}/v1", models: [agent-llm]}}]
models: {{agent-llm: {{}}}}
tenants:
  agents: {{api_keys: [{hash_key("tw-mock-tools")}], models: [agent-llm], cache: {{mode: exact}}}}
""",
        environ={},
    )
    with serve(create_gateway(policy)) as gateway:
        sdk = openai.OpenAI(base_url=gateway + "/v1", api_key="tw-mock-tools", max_retries=0)
        ask: dict[str, Any] = {
            "model": "agent-llm",
            "messages": ASK,
            "tools": TOOLS,
            "temperature": 0,
        }
        calls, finish, _ = streamed_calls(sdk.chat.completions.create(**ask, stream=True))
        raw = sdk.chat.completions.with_raw_response.create(**ask)
    assert finish == "tool_calls"
    assert raw.headers["x-tokenweir-cache"] == "hit"
    (replayed,) = raw.parse().choices[0].message.tool_calls or []
    assert (replayed.id, replayed.function.name, replayed.function.arguments) == (
        calls[0]["id"], calls[0]["name"], calls[0]["arguments"],
    )  # fmt: skip
    assert raw.parse().choices[0].finish_reason == "tool_calls"
