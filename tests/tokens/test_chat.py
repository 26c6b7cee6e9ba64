"""Built-in chat formats: Qwen2/2.5 ChatML and Llama 3 renderings, and their token counts."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from proxy.tokens import MEDIA_TOKENS, ChatTemplateError, load_counter
from proxy.tokens.builtin_templates import chatml, llama3, llama31, qwen2, qwen25
from proxy.tokens.chat import TemplatedCounter, normalise_messages
from tests.shared import tokenizer_file

HELLO = [{"role": "user", "content": "你好"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo actuelle",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = {
    "id": "c1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
TOOL_CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "18°C"},
    {"role": "tool", "tool_call_id": "c2", "content": "sunny"},
]
QWEN_TOOLS_SYSTEM = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Météo actuelle", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}'
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def rendered(render: Any, messages: list[dict[str, Any]], tools: Any = None, **kw: Any) -> str:
    text: str = render(normalise_messages(messages)[0], tools, **kw)
    return text


@pytest.fixture(scope="module")
def qwen() -> TemplatedCounter:
    counter = load_counter(str(tokenizer_file("qwen2.5/qwen.tiktoken")), model="qwen")
    assert isinstance(counter, TemplatedCounter)
    return counter


@pytest.fixture(scope="module")
def llama() -> TemplatedCounter:
    counter = load_counter(str(tokenizer_file("llama-3/tokenizer.json")), model="llama")
    assert isinstance(counter, TemplatedCounter)
    return counter


def test_qwen25_adds_its_default_system_message() -> None:
    assert rendered(qwen25, HELLO) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
        "<|im_end|>\n<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n"
    )


def test_qwen25_chat_count_with_special_tokens_as_one_each(qwen: TemplatedCounter) -> None:
    # 9 special tokens; "system\n" 2, the default system message 16, "user\n" 2, 你好 1,
    # "\n" after each <|im_end|> 2, "assistant\n" 2.
    assert qwen.count_chat(HELLO) == 30
    assert qwen.count_text("<|im_start|>") == qwen.count_text("<|im_end|>") == 1
    assert qwen.chat_format == "builtin:qwen2.5"


def test_qwen2_and_plain_chatml_system_messages() -> None:
    assert rendered(qwen2, HELLO).startswith(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    )
    assert rendered(chatml, HELLO) == "<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n"
    system = [{"role": "system", "content": "Be brief."}, *HELLO]
    assert rendered(qwen25, system) == rendered(chatml, system)


def test_qwen25_tools_calls_and_grouped_results() -> None:
    assert rendered(qwen25, TOOL_CHAT, [WEATHER_TOOL]) == (
        f"<|im_start|>system\nYou are a weather bot.{QWEN_TOOLS_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18°C\n</tool_response>\n<tool_response>\nsunny\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_qwen25_tools_without_a_system_message_use_the_default() -> None:
    assert rendered(qwen25, HELLO, [WEATHER_TOOL]).startswith(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
        "\n\n# Tools\n"
    )


def test_tools_count_in_qwen_chats(qwen: TemplatedCounter) -> None:
    assert qwen.count_chat(HELLO, [WEATHER_TOOL]) > qwen.count_chat(HELLO) + 60


def test_llama3_header_format() -> None:
    system = [{"role": "system", "content": " Be brief. "}, *HELLO]
    assert rendered(llama3, system) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n你好<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_llama31_system_turn_carries_the_dates(llama: TemplatedCounter) -> None:
    text = rendered(llama31, HELLO, date="26 Jul 2024")
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n你好<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert llama.count_text(text) == 37
    today = rendered(llama31, HELLO, date=time.strftime("%d %b %Y"))
    assert llama.count_chat(HELLO) == llama.count_text(today)


def test_llama31_tools_go_in_the_first_user_turn() -> None:
    text = rendered(
        llama31,
        [{"role": "user", "content": "Weather in Paris?"}],
        [WEATHER_TOOL],
        date="1 Jan 2025",
    )
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 1 Jan 2025\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please "
        "respond with a JSON for a function call with its proper arguments that best answers "
        'the given prompt.\n\nRespond in the format {"name": function name, "parameters": '
        "dictionary of argument name and its value}.Do not use variables.\n\n"
        + json.dumps(WEATHER_TOOL, indent=4, ensure_ascii=False)
        + "\n\nWeather in Paris?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_llama31_tool_call_and_result_turns() -> None:
    text = rendered(llama31, TOOL_CHAT[:4], date="1 Jan 2025")
    assert text.endswith(
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
        '<|start_header_id|>ipython<|end_header_id|>\n\n"18°C"<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_llama31_refuses_what_its_template_refuses() -> None:
    two_calls = [*TOOL_CHAT[:2], {"role": "assistant", "content": None, "tool_calls": [CALL, CALL]}]
    with pytest.raises(ChatTemplateError, match="single tool call"):
        rendered(llama31, two_calls)
    with pytest.raises(ChatTemplateError, match="first user message"):
        rendered(llama31, [{"role": "system", "content": "x"}], [WEATHER_TOOL])


def test_content_parts_are_joined_and_media_estimated(qwen: TemplatedCounter) -> None:
    parts = [
        {"type": "text", "text": "你"},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
        {"type": "text", "text": "好"},
    ]
    joined = [{"role": "user", "content": "你\n好"}]
    assert qwen.count_chat([{"role": "user", "content": parts}]) == (
        qwen.count_chat(joined) + MEDIA_TOKENS
    )


def test_completion_prompts_add_what_the_backend_adds(
    qwen: TemplatedCounter, llama: TemplatedCounter
) -> None:
    assert qwen.count_prompt("hello world") == 2
    assert llama.count_prompt("hello world") == 3  # <|begin_of_text|> added
    assert llama.count_prompt(["hello world", "hello"]) == 5
    assert llama.count_prompt([128000, 15339, 1917]) == 3
