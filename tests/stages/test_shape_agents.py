"""Shaping and budgets on the Responses and Messages APIs: each API's own output field, system
prompt place and input, with the word-counting stand-in of test_shape.py."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.apis import AGENT_APIS
from proxy.errors import ContextLengthExceeded
from proxy.outgoing import DEFAULT_OUTPUT_BOUND
from proxy.policy.model import Budget
from proxy.stages.shape import Shape
from tests.stages.test_budget import budgets
from tests.stages.test_shape import WordCounter, context

pytestmark = pytest.mark.anyio


async def test_a_responses_cap_is_max_output_tokens_never_max_tokens() -> None:
    body: dict[str, Any] = {"model": "m", "input": "hi", "max_output_tokens": 500}
    ctx = context(Budget(max_output_tokens=64), body, "responses")
    await Shape(WordCounter())(ctx)
    assert body == {"model": "m", "input": "hi", "max_output_tokens": 64}
    assert (ctx.outgoing.allowance, ctx.outgoing.shaped) == (64, ["max_tokens"])


async def test_a_messages_cap_is_max_tokens() -> None:
    body: dict[str, Any] = {"model": "m", "max_tokens": 500, "messages": []}
    ctx = context(Budget(max_output_tokens=64), body, "messages")
    await Shape(WordCounter())(ctx)
    assert body["max_tokens"] == 64
    assert ctx.outgoing.allowance == 64


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (None, "Be safe."),
        ("Be brief.", "Be safe.\n\nBe brief."),
        ("Be safe. And brief.", "Be safe. And brief."),
        ([{"type": "text", "text": "Be brief."}],
         [{"type": "text", "text": "Be safe."}, {"type": "text", "text": "Be brief."}]),
        ([{"type": "text", "text": "Be safe."}], [{"type": "text", "text": "Be safe."}]),
    ],
)  # fmt: skip
async def test_the_system_prompt_goes_first_in_messages_system(given: Any, expected: Any) -> None:
    body: dict[str, Any] = {"model": "m", "max_tokens": 5, "messages": []}
    if given is not None:
        body["system"] = given
    ctx = context(Budget(system_prompt="Be safe."), body, "messages")
    await Shape(WordCounter())(ctx)
    assert body["system"] == expected
    assert ("system_prompt" in ctx.outgoing.shaped) == (given != expected)


async def test_the_system_prompt_goes_first_in_responses_instructions() -> None:
    body: dict[str, Any] = {"model": "m", "input": "hi", "instructions": "Be brief."}
    ctx = context(Budget(system_prompt="Be safe."), body, "responses")
    await Shape(WordCounter())(ctx)
    assert body["instructions"] == "Be safe.\n\nBe brief."


async def test_the_input_counted_is_the_whole_conversation() -> None:
    body: dict[str, Any] = {
        "model": "m",
        "instructions": "one two",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "three four five"}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "six"},
        ],
    }
    ctx = context(Budget(max_input_tokens=100), body, "responses")
    await Shape(WordCounter())(ctx)
    # WordCounter: 4 per message plus its words (a parts list counts as its repr's words).
    messages, _ = AGENT_APIS["responses"].to_chat(body)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[3]["content"] == "six"
    assert ctx.counted_input_tokens is not None
    assert ctx.counted_input_tokens >= 4 * 4 + 2 + 1


async def test_an_input_over_the_limit_is_refused_not_trimmed() -> None:
    body: dict[str, Any] = {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "a b c d e f g h"}],
    }
    ctx = context(Budget(max_input_tokens=10), body, "messages")
    with pytest.raises(ContextLengthExceeded):
        await Shape(WordCounter())(ctx)


def test_messages_tool_use_and_results_are_counted_as_chat_tool_calls() -> None:
    body = {
        "system": [{"type": "text", "text": "sys"}],
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Oslo"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "rain"},
            ]},
        ],
        "tools": [{"name": "weather", "input_schema": {"type": "object"}}],
    }  # fmt: skip
    messages, tools = AGENT_APIS["messages"].to_chat(body)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    call = messages[2]["tool_calls"][0]
    assert call["function"] == {"name": "weather", "arguments": '{"city":"Oslo"}'}
    assert messages[3] == {"role": "tool", "tool_call_id": "t1", "content": "rain"}
    assert tools == [
        {"type": "function", "function": {"name": "weather", "description": "",
                                          "parameters": {"type": "object"}}}
    ]  # fmt: skip


async def test_a_quotad_request_without_a_cap_gets_the_default_in_its_own_field() -> None:
    stage, _ = budgets()
    body: dict[str, Any] = {"model": "m", "input": "hi"}
    ctx = context(Budget(tokens_per_day=10_000), body, "responses")
    ctx.counted_input_tokens = 5
    await stage(ctx)
    assert body["max_output_tokens"] == ctx.outgoing.allowance == DEFAULT_OUTPUT_BOUND
    assert "max_tokens" not in body
    await stage.settle(ctx)


async def test_stop_stream_at_budget_shortens_a_message_in_max_tokens() -> None:
    stage, _ = budgets()
    body: dict[str, Any] = {"model": "m", "max_tokens": 5000, "messages": []}
    ctx = context(Budget(tokens_per_day=1000, stop_stream_at_budget=True), body, "messages")
    ctx.counted_input_tokens, ctx.outgoing.allowance = 100, 5000
    await stage(ctx)
    assert body["max_tokens"] == ctx.outgoing.allowance == 900
    assert set(body) == {"model", "max_tokens", "messages"}
    await stage.settle(ctx)
