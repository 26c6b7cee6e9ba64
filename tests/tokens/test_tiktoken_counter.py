"""OpenAI encodings: the cookbook's published ids and chat counts, by name and by file path."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tiktoken

from proxy.tokens import MEDIA_TOKENS, MEDIA_TOKENS_LOW, TokenCounter, TokenizerError, load_counter
from proxy.tokens.tiktoken_counter import encoding_from_file
from tests.shared import offline_tiktoken, tokenizer_file
from tests.tokens import CORPUS

ENCODINGS = ("cl100k_base", "o200k_base")

# From OpenAI's cookbook "How to count tokens with tiktoken".
PUBLISHED_IDS = [
    ("cl100k_base", "antidisestablishmentarianism", [519, 85342, 34500, 479, 8997, 2191]),
    ("o200k_base", "antidisestablishmentarianism", [493, 129901, 376, 160388, 21203, 2367]),
    ("cl100k_base", "2 + 2 = 4", [17, 489, 220, 17, 284, 220, 19]),
    ("o200k_base", "2 + 2 = 4", [17, 659, 220, 17, 314, 220, 19]),
    (
        "cl100k_base",
        "お誕生日おめでとう",
        [33334, 45918, 243, 21990, 9080, 33334, 62004, 16556, 78699],
    ),
    ("o200k_base", "お誕生日おめでとう", [8930, 9697, 243, 128225, 8930, 17693, 4344, 48669]),
    ("cl100k_base", "tiktoken is great!", [83, 1609, 5963, 374, 2294, 0]),
]

# The cookbook's chat example: 129 prompt tokens on gpt-3.5-turbo/gpt-4, 124 on gpt-4o, as
# counted by its function and reported by the OpenAI API.
COOKBOOK_MESSAGES = [
    {
        "role": "system",
        "content": "You are a helpful, pattern-following assistant that translates corporate "
        "jargon into plain English.",
    },
    {
        "role": "system",
        "name": "example_user",
        "content": "New synergies will help drive top-line growth.",
    },
    {
        "role": "system",
        "name": "example_assistant",
        "content": "Things working well together will increase revenue.",
    },
    {
        "role": "system",
        "name": "example_user",
        "content": "Let's circle back when we have more bandwidth to touch base on "
        "opportunities for increased leverage.",
    },
    {
        "role": "system",
        "name": "example_assistant",
        "content": "Let's talk later when we're less busy about how to do better.",
    },
    {
        "role": "user",
        "content": "This late pivot means we don't have time to boil the ocean for the client "
        "deliverable.",
    },
]
# The cookbook's tools example: 105 prompt tokens on gpt-3.5-turbo/gpt-4, 101 on gpt-4o.
WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_current_weather",
            "description": "Get the current weather in a given location",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {
                        "type": "string",
                        "description": "The city and state, e.g. San Francisco, CA",
                    },
                    "unit": {
                        "type": "string",
                        "description": "The unit of temperature to return",
                        "enum": ["celsius", "fahrenheit"],
                    },
                },
                "required": ["location"],
            },
        },
    }
]
WEATHER_MESSAGES = [
    {
        "role": "system",
        "content": "You are a helpful assistant that can answer to questions about the weather.",
    },
    {"role": "user", "content": "What's the weather like in San Francisco?"},
]


@pytest.fixture(scope="module", autouse=True)
def tiktoken_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with offline_tiktoken(tmp_path_factory.mktemp("tiktoken")) as cache_dir:
        yield cache_dir


@pytest.fixture(scope="module", params=ENCODINGS)
def encoding_name(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(scope="module")
def by_name(encoding_name: str) -> TokenCounter:
    return load_counter(f"tiktoken:{encoding_name}", model="gpt")


@pytest.fixture(scope="module")
def by_path(encoding_name: str) -> TokenCounter:
    return load_counter(str(tokenizer_file(f"{encoding_name}.tiktoken")), model="gpt")


@pytest.mark.parametrize(("name", "text", "ids"), PUBLISHED_IDS)
def test_published_ids_by_name_and_by_path(name: str, text: str, ids: list[int]) -> None:
    from_file, _ = encoding_from_file(tokenizer_file(f"{name}.tiktoken"), None)
    assert tiktoken.get_encoding(name).encode_ordinary(text) == ids
    assert from_file.encode_ordinary(text) == ids
    assert load_counter(f"tiktoken:{name}", model="gpt").count_text(text) == len(ids)


def test_an_encoding_keeps_its_ranks_in_tiktokens_core_only() -> None:
    """The 200k ranks read from the file (24 MB of Python objects) are not kept once tiktoken's
    Rust core has its copy: loading leaves well under a megabyte of Python objects behind."""
    gc.collect()
    tracemalloc.start()
    try:
        encoding, _ = encoding_from_file(tokenizer_file("o200k_base.tiktoken"), None)
        gc.collect()
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kept < 1_000_000
    assert encoding.encode_ordinary("2 + 2 = 4") == [17, 659, 220, 17, 314, 220, 19]


def test_file_and_cache_agree_on_the_corpus(encoding_name: str) -> None:
    cached = tiktoken.get_encoding(encoding_name)
    from_file, family = encoding_from_file(tokenizer_file(f"{encoding_name}.tiktoken"), None)
    assert family.name == encoding_name
    for text in CORPUS:
        assert from_file.encode_ordinary(text) == cached.encode_ordinary(text), text


def test_names_say_where_the_encoding_came_from(
    by_name: TokenCounter, by_path: TokenCounter
) -> None:
    assert by_name.name.startswith("tiktoken:")
    assert by_name.exact
    assert by_path.name.endswith(".tiktoken#" + by_name.name.removeprefix("tiktoken:"))


def test_cookbook_chat_example(by_name: TokenCounter, by_path: TokenCounter) -> None:
    expected = {"tiktoken:cl100k_base": 129, "tiktoken:o200k_base": 124}[by_name.name]
    assert by_name.count_chat(COOKBOOK_MESSAGES) == expected
    assert by_path.count_chat(COOKBOOK_MESSAGES) == expected


def test_cookbook_tools_example(by_name: TokenCounter) -> None:
    expected = {"tiktoken:cl100k_base": 105, "tiktoken:o200k_base": 101}[by_name.name]
    assert by_name.count_chat(WEATHER_MESSAGES, WEATHER_TOOLS) == expected


def test_chat_overhead_per_message_name_and_reply(by_name: TokenCounter) -> None:
    text = "Bonjour, comment ça va ?"
    one = by_name.count_chat([{"role": "user", "content": text}])
    assert one == 3 + by_name.count_text("user") + by_name.count_text(text) + 3
    named = by_name.count_chat([{"role": "user", "name": "ana", "content": text}])
    assert named == one + by_name.count_text("ana") + 1


def test_content_parts_count_text_and_a_fixed_media_estimate(by_name: TokenCounter) -> None:
    plain = by_name.count_chat([{"role": "user", "content": "What is in this picture?"}])
    image: dict[str, Any] = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}
    low: dict[str, Any] = {"type": "image_url", "image_url": {"url": "x", "detail": "low"}}
    parts = [{"type": "text", "text": "What is in this picture?"}, image, low]
    assert by_name.count_chat([{"role": "user", "content": parts}]) == (
        plain + MEDIA_TOKENS + MEDIA_TOKENS_LOW
    )


def test_assistant_tool_calls_and_results_are_counted(by_name: TokenCounter) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    before = by_name.count_chat(WEATHER_MESSAGES)
    after = by_name.count_chat(
        [
            *WEATHER_MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "18°C and sunny"},
        ]
    )
    assert after - before >= 6 + by_name.count_text('{"a": 1}') + by_name.count_text("18°C")


def test_special_token_text_is_plain_text_for_openai(by_name: TokenCounter) -> None:
    assert by_name.count_text("<|endoftext|>") > 1


def test_completion_prompts(by_name: TokenCounter) -> None:
    hello = by_name.count_text("hello world")
    assert by_name.count_prompt("hello world") == hello
    assert by_name.count_prompt(["hello world", "hello world"]) == 2 * hello
    assert by_name.count_prompt([1, 2, 3]) == 3
    assert by_name.count_prompt([[1, 2], [3]]) == 3
    assert by_name.count_prompt([]) == 0


def test_a_cache_miss_fails_at_once_with_advice() -> None:
    with pytest.raises(TokenizerError, match="TIKTOKEN_CACHE_DIR") as caught:
        load_counter("tiktoken:r50k_base", model="davinci")
    assert "model 'davinci'" in str(caught.value)


def test_unknown_encoding_lists_the_known_ones() -> None:
    with pytest.raises(TokenizerError, match=r"known: .*o200k_base"):
        load_counter("tiktoken:o300k_base", model="m")


@pytest.mark.parametrize("blank", [" ", "\t", "\u3000"])
def test_a_whitespace_run_of_a_million_is_counted(by_name: TokenCounter, blank: str) -> None:
    """tiktoken's regex engine panics on a run of about a million whitespace characters (o200k,
    Qwen, Llama 3); the count cuts such a run and gets what a whole count would."""
    long_run = "Hi" + blank * 1_100_000 + "there"
    assert by_name.count_text(long_run) > 1_100_000 // 128
    encoding = tiktoken.get_encoding(by_name.name.removeprefix("tiktoken:"))
    for length in (65_537, 200_001):  # a cut or three, on runs tiktoken counts whole
        text = "Hi" + blank * length + "there"
        assert by_name.count_text(text) == len(encoding.encode_ordinary(text))
