"""The openai SDK, unchanged, through the gateway to the simulated backend."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from tests.conftest import ALPHA_KEY, BACKEND_KEY, BETA_KEY

CHAT = [{"role": "user", "content": "Tell me about the sea."}]


def test_chat_non_stream_returns_completion_with_usage(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="mock-llm", messages=CHAT, max_tokens=12)
    assert reply.object == "chat.completion"
    assert reply.model == "mock-llm"
    assert reply.choices[0].message.role == "assistant"
    assert len(reply.choices[0].message.content.split()) == 12
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 12
    assert reply.usage.prompt_tokens > 0


def test_chat_stream_delivers_every_token_and_no_usage_unless_asked(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(model="mock-llm", messages=CHAT, max_tokens=20, stream=True)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 20
    assert chunks[-1].choices[0].finish_reason == "length"
    # The gateway asked the backend for usage; the client did not, so it must not see the chunk.
    assert all(c.choices for c in chunks)
    assert all(c.usage is None for c in chunks)


def test_chat_stream_include_usage_gets_final_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="mock-llm",
            messages=CHAT,
            max_tokens=15,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == 15
    assert sum(1 for c in chunks if c.usage is not None) == 1


def test_text_completion_stream_and_non_stream(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="mock-llm", prompt="Once upon", max_tokens=8)
    assert len(whole.choices[0].text.split()) == 8
    assert whole.usage is not None
    assert whole.usage.completion_tokens == 8
    streamed = list(
        client.completions.create(model="mock-llm", prompt="Once upon", max_tokens=8, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text


def test_embeddings_through_the_gateway(client: openai.OpenAI) -> None:
    result = client.embeddings.create(model="mock-embed", input=["first", "second"])
    assert [d.index for d in result.data] == [0, 1]
    assert len(result.data[0].embedding) == 384
    assert result.data[0].embedding != result.data[1].embedding
    assert result.usage.prompt_tokens > 0


def test_models_lists_only_the_tenants_models(gateway_url: str) -> None:
    for key, expected in ((ALPHA_KEY, ["mock-llm", "mock-embed"]), (BETA_KEY, ["mock-small"])):
        with openai.OpenAI(base_url=gateway_url + "/v1", api_key=key, max_retries=0) as sdk:
            assert [m.id for m in sdk.models.list()] == expected


def test_one_model_is_shown_only_to_a_tenant_that_may_use_it(gateway_url: str) -> None:
    with openai.OpenAI(base_url=gateway_url + "/v1", api_key=ALPHA_KEY, max_retries=0) as sdk:
        model = sdk.models.retrieve("mock-llm")
        assert (model.id, model.object, model.owned_by) == ("mock-llm", "model", "tokenweir")
        for hidden in ("mock-small", "no-such-model", "x" * 1000):
            with pytest.raises(openai.NotFoundError) as refused:
                sdk.models.retrieve(hidden)
            error = refused.value.body
            assert isinstance(error, dict)
            assert (error["code"], error["param"]) == ("model_not_found", "model")
            assert len(error["message"]) < 200
    with openai.OpenAI(base_url=gateway_url + "/v1", api_key=BETA_KEY, max_retries=0) as sdk:
        assert sdk.models.retrieve("mock-small").id == "mock-small"
    answer = httpx.get(gateway_url + "/v1/models/mock-llm")
    assert answer.status_code == 401
    chat = {"model": "x" * 60_000, "messages": CHAT}  # under the 64 KiB body limit
    refused = httpx.post(
        gateway_url + "/v1/chat/completions",
        json=chat,
        headers={"authorization": f"Bearer {ALPHA_KEY}"},
    )
    assert refused.status_code == 404
    assert len(refused.content) < 400  # the client's string is quoted, not echoed whole


def test_unknown_fields_pass_through_and_backend_key_replaces_client_key(
    client: openai.OpenAI, backend: httpx.Client
) -> None:
    client.chat.completions.create(
        model="mock-llm",
        messages=CHAT,
        max_tokens=3,
        extra_body={"guided_choice": ["yes", "no"], "top_k": 7, "repetition_penalty": 1.05},
    )
    stats = backend.get("/mock/stats").json()
    sent = stats["last_request"]
    assert sent["guided_choice"] == ["yes", "no"]
    assert sent["top_k"] == 7
    assert sent["repetition_penalty"] == 1.05
    assert stats["last_authorization"] == f"Bearer {BACKEND_KEY}"


def test_stream_asks_backend_for_usage(client: openai.OpenAI, backend: httpx.Client) -> None:
    list(client.chat.completions.create(model="mock-llm", messages=CHAT, max_tokens=2, stream=True))
    sent = backend.get("/mock/stats").json()["last_request"]
    assert sent["stream_options"] == {"include_usage": True}


def test_every_answer_has_request_id_and_cache_header(gateway_url: str) -> None:
    headers = {"authorization": f"Bearer {ALPHA_KEY}", "x-request-id": "trace-42"}
    body = {"model": "mock-llm", "messages": CHAT, "max_tokens": 2}
    with httpx.Client(base_url=gateway_url) as http:
        ok = http.post("/v1/chat/completions", json=body, headers=headers)
        bad = http.post("/v1/chat/completions", json={"model": "mock-llm"}, headers=headers)
        fresh = [
            http.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer x"})
            for _ in range(2)
        ]
    assert ok.headers["x-request-id"] == "trace-42"
    assert bad.headers["x-request-id"] == "trace-42"
    made = [answer.headers["x-request-id"] for answer in fresh]
    assert all(re.fullmatch("req_[0-9a-f]{32}", found) for found in made)  # 128 random bits
    assert made[0] != made[1]
    assert ok.headers["x-tokenweir-cache"] == "bypass"


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
def test_health_and_ready(gateway_url: str, path: str) -> None:
    answer = httpx.get(gateway_url + path)
    assert answer.status_code == 200
    assert answer.json()["status"] in {"ok", "ready"}
