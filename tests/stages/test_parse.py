"""Every client field the gateway reads, counts or relays is type-checked: a wrong one is a 400
`invalid_request_error` naming the field, never a 500; unknown fields still pass untouched."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from tests.servers import serve
from tests.shared import tokenizer_file

KEY = "tw-parse"
HI = [{"role": "user", "content": "hi"}]


def _deep(depth: int) -> object:
    value: object = "x"
    for _ in range(depth):
        value = [value]
    return value


def _deep_json(depth: int) -> str:
    return "[" * depth + '"x"' + "]" * depth


@pytest.fixture(scope="module")
def gateway(backend_url: str) -> Iterator[str]:
    """Quotas on, so every request is counted: with OpenAI's rule (mock-llm), a tiktoken file
    with Qwen's template (qwen) and a Hugging Face template (llama)."""
    qwen = tokenizer_file("qwen2.5/qwen.tiktoken")
    llama = tokenizer_file("llama-3/tokenizer.json")
    policy = parse_policy(
        f"""
backends: [{{name: m, url: "{backend_url}/v1", models: [mock-llm, qwen, llama, mock-embed]}}]
models: {{mock-llm: {{}}, mock-embed: {{}}, qwen: {{tokenizer: "{qwen}"}},
          llama: {{tokenizer: "hf:{llama}"}}}}
tenants:
  app:
    api_keys: [{hash_key(KEY)}]
    models: [mock-llm, qwen, llama, mock-embed]
    budget: {{tokens_per_day: 100000000, max_output_tokens: 8}}
    cache: {{mode: exact}}
""",
        environ={},
    )
    with serve(create_app(policy)) as url:
        yield url


def _post(url: str, path: str, body: str | dict[str, object]) -> httpx.Response:
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    content = body if isinstance(body, str) else None
    with httpx.Client(base_url=url, timeout=20) as http:
        if content is not None:
            return http.post(path, content=content, headers=headers)
        return http.post(path, json=body, headers=headers)


CHAT_CASES: list[tuple[dict[str, object], str, str]] = [
    ({"messages": [{"role": ["user"], "content": "hi"}]}, "messages[0].role", "invalid_type"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "invalid_value"),
    ({"tools": True}, "tools", "invalid_type"),
    ({"tools": 7}, "tools", "invalid_type"),
    ({"tools": [5]}, "tools[0]", "invalid_type"),
    ({"tools": [{"type": "function", "function": 5}]}, "tools[0].function", "invalid_type"),
    ({"tools": [{"type": "function", "function": {"name": 5}}]}, "tools[0].function.name",
     "invalid_type"),
    ({"tools": [{"function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters",
     "invalid_type"),
    ({"seed": 1e300}, "seed", "invalid_type"),
    ({"seed": 2**64 - 1}, "seed", "integer_above_max_value"),
    ({"frequency_penalty": 1e20, "temperature": 0}, "frequency_penalty",
     "decimal_above_max_value"),
    ({"presence_penalty": -3}, "presence_penalty", "decimal_below_min_value"),
    ({"logit_bias": 5}, "logit_bias", "invalid_type"),
    ({"logit_bias": {"50256": 1e300}}, "logit_bias.50256", "decimal_above_max_value"),
    ({"stop": 5}, "stop", "invalid_type"),
    ({"stop": ["a", 1]}, "stop[1]", "invalid_type"),
    ({"n": 1.5}, "n", "invalid_type"),
    ({"max_tokens": True}, "max_tokens", "invalid_type"),
    ({"max_completion_tokens": 1e300}, "max_completion_tokens", "invalid_type"),
    ({"tool_choice": 5}, "tool_choice", "invalid_type"),
    ({"tool_choice": {"type": "function", "function": {"name": []}}},
     "tool_choice.function.name", "invalid_type"),
    ({"functions": {"name": "f"}}, "functions", "invalid_type"),
    ({"function_call": 3}, "function_call", "invalid_type"),
    ({"response_format": "json"}, "response_format", "invalid_type"),
    ({"user": 5}, "user", "invalid_type"),
    ({"logprobs": 1}, "logprobs", "invalid_type"),
    ({"top_logprobs": 10**6}, "top_logprobs", "integer_above_max_value"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "invalid_type"),
    ({"metadata": {"a": 1}}, "metadata.a", "invalid_type"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage",
     "invalid_type"),
    ({"stream": True, "stream_options": []}, "stream_options", "invalid_type"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
    ({"messages": [{"role": "user", "content": [5]}]}, "messages[0].content[0]",
     "invalid_type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ["x"]}]}]},
     "messages[0].content[0].text", "invalid_type"),
    ({"messages": [{"role": "user", "content": "hi", "name": {"a": 1}}]}, "messages[0].name",
     "invalid_type"),
    ({"messages": [{"role": "assistant", "tool_calls": 5}]}, "messages[0].tool_calls",
     "invalid_type"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": 5}]}]},
     "messages[0].tool_calls[0].function", "invalid_type"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}]},
     "messages[0].tool_calls[0].function.arguments", "invalid_type"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]},
     "messages[0].tool_call_id", "invalid_type"),
    ({"messages": [HI[0], 5]}, "messages[1]", "invalid_type"),
]  # fmt: skip


@pytest.mark.parametrize("model", ["mock-llm", "qwen", "llama"])
@pytest.mark.parametrize(("change", "param", "code"), CHAT_CASES)
def test_a_wrong_chat_field_is_a_400_naming_it(
    gateway: str, model: str, change: dict[str, object], param: str, code: str
) -> None:
    answer = _post(gateway, "/v1/chat/completions", {"model": model, "messages": HI, **change})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert param in error["message"]


@pytest.mark.parametrize(
    "body",
    [
        {"model": "qwen", "top_p": 5, "messages": HI, "temperature": "hot"},
        {"model": "qwen", "messages": HI, "temperature": "hot", "top_p": 5},
        {"temperature": "hot", "top_p": 5, "messages": HI, "model": "qwen"},
    ],
)
def test_of_several_wrong_fields_the_first_in_the_schemas_order_is_named(
    gateway: str, body: dict[str, object]
) -> None:
    answer = _post(gateway, "/v1/chat/completions", body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "temperature"  # whatever the body's order


def test_wrong_messages_are_named_before_any_other_wrong_field(gateway: str) -> None:
    body = {"model": "qwen", "temperature": "hot", "messages": [{"role": "user", "content": 1}]}
    answer = _post(gateway, "/v1/chat/completions", body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"].startswith("messages[0]")


@pytest.mark.parametrize(
    ("path", "change", "param", "code"),
    [
        ("/v1/completions", {"prompt": [1, "a"]}, "prompt[1]", "invalid_type"),
        ("/v1/completions", {"prompt": ["a", 1]}, "prompt[1]", "invalid_type"),
        ("/v1/completions", {"prompt": [-1]}, "prompt[0]", "integer_below_min_value"),
        ("/v1/completions", {"prompt": [2**40]}, "prompt[0]", "integer_above_max_value"),
        ("/v1/completions", {"prompt": [True]}, "prompt[0]", "invalid_type"),
        ("/v1/completions", {"prompt": [[1], []]}, "prompt[1]", "empty_array"),
        ("/v1/completions", {"prompt": {"text": "x"}}, "prompt", "invalid_type"),
        ("/v1/completions", {"prompt": "x", "seed": 1e300}, "seed", "invalid_type"),
        ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs", "invalid_type"),
        ("/v1/completions", {"prompt": "x", "best_of": 1e9}, "best_of", "invalid_type"),
        ("/v1/completions", {"prompt": "x", "suffix": 1}, "suffix", "invalid_type"),
        ("/v1/completions", {"prompt": "x", "echo": "no"}, "echo", "invalid_type"),
        ("/v1/completions", {"prompt": "x", "max_completion_tokens": []}, "max_completion_tokens",
         "unsupported_parameter"),
        # chat's name; completions backends read only max_tokens, so it would bound nothing
        ("/v1/completions", {"prompt": "x", "max_completion_tokens": 1}, "max_completion_tokens",
         "unsupported_parameter"),
        ("/v1/embeddings", {"input": [None]}, "input[0]", "invalid_type"),
        ("/v1/embeddings", {"input": [[1, 2], "a"]}, "input[1]", "invalid_type"),
        ("/v1/embeddings", {"input": ["a"] * 2049}, "input", "array_above_max_length"),
        ("/v1/embeddings", {"input": "a", "encoding_format": "hex"}, "encoding_format",
         "invalid_value"),
        ("/v1/embeddings", {"input": "a", "user": ["u"]}, "user", "invalid_type"),
    ],
)  # fmt: skip
def test_a_wrong_completions_or_embeddings_field_is_a_400_naming_it(
    gateway: str, path: str, change: dict[str, object], param: str, code: str
) -> None:
    model = "mock-embed" if path.endswith("embeddings") else "qwen"
    answer = _post(gateway, path, {"model": model, **change})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)


@pytest.mark.parametrize("depth", [255, 600, 1020])
@pytest.mark.parametrize(
    ("template", "param"),
    [
        ('{{"model": "qwen", "messages": [{{"role": "user", "content": "x"}}], "x": {0}}}', "x[0]"),
        ('{{"model": "qwen", "messages": [{{"role": "user", "content": {0}}}]}}', "messages[0]"),
        ('{{"model": "qwen", "prompt": {0}}}', "prompt[0]"),
    ],
)
def test_a_field_nested_past_what_the_backend_request_can_carry_is_a_400_naming_it(
    gateway: str, depth: int, template: str, param: str
) -> None:
    path = "/v1/completions" if '"prompt"' in template else "/v1/chat/completions"
    answer = _post(gateway, path, template.format(_deep_json(depth)))
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param
    assert "254 levels" in error["message"]


def test_ten_thousand_levels_are_refused_by_the_json_reader(gateway: str) -> None:
    body = '{"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "x": %s}'
    answer = _post(gateway, "/v1/chat/completions", body % _deep_json(10_000))
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "invalid_json"
    assert "1024 levels" in answer.json()["error"]["message"]


@pytest.mark.parametrize(
    "change",
    [
        {"x": _deep(200), "top_k": 1e300, "min_p": "anything"},  # unknown: the backend's to judge
        {"temperature": 0, "seed": 7, "extra_huge": 1e300},  # cached: the key is still written
        {"max_tokens": None, "stream": None, "tools": None, "user": None},  # null means omitted
        {"tools": [{"type": "custom", "custom": {"name": "grep"}}], "tool_choice": "auto"},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {"messages": [{"role": "user", "content": "<|im_start|>system\n<|endoftext|>"}]},
    ],
)
def test_valid_and_unknown_fields_still_reach_the_backend(
    gateway: str, change: dict[str, object]
) -> None:
    for model in ("mock-llm", "qwen", "llama"):
        answer = _post(gateway, "/v1/chat/completions", {"model": model, "messages": HI, **change})
        assert answer.status_code == 200, answer.text
