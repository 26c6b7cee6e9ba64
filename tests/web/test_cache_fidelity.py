"""What the exact cache may answer: only what a stored answer reproduces in full, as a whole
answer and as a stream. A backend on 127.0.0.1 (Starlette) answers completions with the
log-probabilities OpenAI and vLLM send for `logprobs: 0` (the sampled tokens' own), and chat
with the message a test puts in the request's `reply` field (passed through untouched)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from tests.servers import serve

KEY = "tw-test-cache-fidelity"


async def completions(request: Request) -> JSONResponse:
    body = await request.json()
    logprobs = None
    if body.get("logprobs") is not None:
        logprobs = {
            "tokens": ["Paris"],
            "token_logprobs": [-0.01],
            "top_logprobs": [{"Paris": -0.01}] if body["logprobs"] else None,
            "text_offset": [0],
        }
    choice = {"index": 0, "text": "Paris", "logprobs": logprobs, "finish_reason": "stop"}
    return JSONResponse(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1,
            "model": "logprob-llm",
            "choices": [choice],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        }
    )


async def chat(request: Request) -> Response:
    body = await request.json()
    if body.get("deep"):  # a tool call's arguments nested so deep: JSON, if hardly useful
        return Response(deep_answer(body["deep"]), media_type="application/json")
    message = body["reply"]
    finish = body.get("finish") or ("function_call" if message.get("function_call") else "stop")
    if body.get("stream"):
        return StreamingResponse(streamed(message, finish), media_type="text/event-stream")
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
    # vLLM's extras, sent as vLLM sends them: null unless asked for
    ids = body.get("return_token_ids")
    choice["token_ids"] = [12366] if ids else None
    prompt_logprobs = None if body.get("prompt_logprobs") is None else [None, {"17": -0.5}]
    answer = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "logprob-llm",
        "choices": [choice],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        "prompt_token_ids": [1, 17] if ids else None,
        "prompt_logprobs": prompt_logprobs,
    }
    if body.get("surrogate"):  # the reply's "?" as a lone surrogate's escape, as JavaScript writes
        raw = orjson.dumps(answer).replace(b"?", b"\\ud83d")
        return Response(raw, media_type="application/json")
    return JSONResponse(answer)


def streamed(message: dict[str, Any], finish: str) -> Iterator[bytes]:
    """`message`'s text as a chat stream, a word a chunk, ended by `finish`, usage and [DONE]."""
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1}
    deltas = [{"role": "assistant", "content": ""}]
    text = message.get("content")
    deltas += [{"content": word} for word in (text if isinstance(text, str) else "").split(" ")]
    for delta in deltas:
        choice = {"index": 0, "delta": delta, "finish_reason": None}
        yield b"data: " + orjson.dumps({**head, "choices": [choice]}) + b"\n\n"
    ending = {"index": 0, "delta": {}, "finish_reason": finish}
    yield b"data: " + orjson.dumps({**head, "choices": [ending]}) + b"\n\n"
    usage = {"prompt_tokens": 5, "completion_tokens": len(deltas) - 1, "total_tokens": 9}
    yield b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}) + b"\n\n"
    yield b"data: [DONE]\n\n"


def deep_answer(levels: int) -> bytes:
    return (
        b'{"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "logprob-llm", '
        b'"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": '
        b'"assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", '
        b'"function": {"name": "f", "arguments": '
        + b"[" * levels
        + b"1"
        + b"]" * levels
        + b'}}]}}], "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}'
    )


@pytest.fixture
def url() -> Iterator[str]:
    backend = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ]
    )
    with serve(backend) as backend_url:
        policy = parse_policy(
            f"""
backends:
  - {{name: b, url: {backend_url}/v1, models: [logprob-llm]}}
models:
  logprob-llm: {{}}
tenants:
  alpha:
    api_keys: [{hash_key(KEY)}]
    models: [logprob-llm]
    limits: {{max_concurrent: 1}}  # a request that never gives its slot back shows as a 429
    cache: {{mode: exact}}
""",
            file="fidelity.yaml",
            environ={},
        )
        with serve(create_app(policy)) as gateway_url:
            yield gateway_url


def complete(url: str, **fields: Any) -> httpx.Response:
    payload = {"model": "logprob-llm", "prompt": "The capital of France is", "temperature": 0}
    auth = {"authorization": f"Bearer {KEY}"}
    answer = httpx.post(url + "/v1/completions", json={**payload, **fields}, headers=auth)
    assert answer.status_code == 200, answer.text
    return answer


@pytest.mark.parametrize("logprobs", [0, 1])
def test_a_completion_asked_for_logprobs_is_never_answered_without_them(
    url: str, logprobs: int
) -> None:
    first, second = (complete(url, logprobs=logprobs) for _ in range(2))
    for answer in (first, second):
        assert answer.json()["choices"][0]["logprobs"]["tokens"] == ["Paris"]
    assert second.headers["x-tokenweir-cache"] != "hit"


def test_a_completion_without_logprobs_is_still_cached(url: str) -> None:
    first, second = complete(url), complete(url)
    assert (first.headers["x-tokenweir-cache"], second.headers["x-tokenweir-cache"]) == (
        "miss",
        "hit",
    )


def converse(url: str, reply: dict[str, Any], *, stream: bool, **fields: Any) -> httpx.Response:
    """A chat request whose answer is `reply` (streamed as its content's words)."""
    payload = {
        "model": "logprob-llm",
        "messages": [{"role": "user", "content": "Call f."}],
        "temperature": 0,
        "reply": reply,
        "stream": stream,
        **fields,
    }
    auth = {"authorization": f"Bearer {KEY}"}
    return httpx.post(url + "/v1/chat/completions", json=payload, headers=auth, timeout=10)


@pytest.mark.parametrize(
    ("asked", "field"),
    [({"return_token_ids": True}, "prompt_token_ids"), ({"prompt_logprobs": 0}, "prompt_logprobs")],
)
def test_a_chat_asked_for_token_ids_or_prompt_logprobs_is_never_answered_without_them(
    url: str, asked: dict[str, Any], field: str
) -> None:
    """vLLM's `return_token_ids` (RL trainers read the sampled ids) and `prompt_logprobs` add
    fields a stored answer does not keep: the repeat came from the cache without them
    (`token_ids` and `prompt_token_ids` null)."""
    reply = {"role": "assistant", "content": "Paris"}
    first, second = (converse(url, reply, stream=False, **asked) for _ in range(2))
    for answer in (first, second):
        assert answer.json()[field] is not None
    assert second.headers["x-tokenweir-cache"] != "hit"


@pytest.mark.parametrize(
    "reply",
    [
        pytest.param(
            {
                "role": "assistant",
                "content": None,
                "function_call": {"name": "f", "arguments": "{}"},
            },
            id="a-legacy-function-call",
        ),
        pytest.param(
            {"role": "assistant", "content": "hi", "audio": {"id": "a1", "data": "AAAA"}},
            id="audio",
        ),
        pytest.param({"role": "assistant", "content": "hi", "tool_calls": "f"}, id="calls-text"),
        pytest.param({"role": "assistant", "content": "hi", "tool_calls": [7]}, id="calls-numbers"),
        pytest.param(
            {"role": "assistant", "content": [{"type": "text", "text": "hi"}]},
            id="content-parts",  # Mistral's reasoning models answer so
        ),
        pytest.param(
            {"role": "assistant", "content": "hi", "reasoning_content": {"text": "hmm"}},
            id="reasoning-not-text",
        ),
    ],
)
def test_a_whole_answer_a_stream_replay_would_not_carry_in_full_is_not_cached(
    url: str, reply: dict[str, Any]
) -> None:
    whole = converse(url, reply, stream=False)
    assert whole.status_code == 200
    assert whole.json()["choices"][0]["message"] == reply
    again = converse(url, reply, stream=True)
    assert again.headers["x-tokenweir-cache"] == "miss"


def test_a_whole_answer_with_empty_extra_fields_is_still_cached(url: str) -> None:
    reply = {
        "role": "assistant", "content": "hi", "refusal": None, "annotations": [],
        "audio": None, "function_call": None, "tool_calls": [],
    }  # fmt: skip
    first = converse(url, reply, stream=False)
    again = converse(url, reply, stream=True)
    assert (first.headers["x-tokenweir-cache"], again.headers["x-tokenweir-cache"]) == (
        "miss",
        "hit",
    )
    assert b"hi" in again.content


@pytest.mark.parametrize(
    ("finish", "kept"),
    [("abort", False), ("error", False), ("content_filter", False), ("length", True)],
)
@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_the_backend_says_it_cut_short_is_relayed_and_not_kept(
    url: str, finish: str, kept: bool, stream: bool
) -> None:
    """vLLM and SGLang end an answer their engine aborted (as when vLLM pauses generation to swap
    weights) with `finish_reason: "abort"` after part of its text; vLLM and Mistral have
    `"error"`, and a content filter cuts an answer short. Such a half answer was stored, and
    every repeat within the ttl got it from the cache while the backend would answer in full.
    An answer cut by its own bound (`length`) is what the same request gets again: kept."""
    reply = {"role": "assistant", "content": "Paris is the cap"}
    first = converse(url, reply, stream=stream, finish=finish)
    again = converse(url, reply, stream=stream, finish=finish)
    assert first.status_code == again.status_code == 200
    assert finish in first.text
    assert "cap" in first.text
    assert again.headers["x-tokenweir-cache"] == ("hit" if kept else "miss")


@pytest.mark.parametrize("levels", [400, 248])
def test_an_answer_nested_deeper_than_can_be_replayed_is_relayed_and_not_kept(
    url: str, levels: int
) -> None:
    """orjson reads 1,024 levels but writes 254. At 400, storing the answer raised while the
    request settled: the client's answer was cut off and its concurrency slot never given back
    (every later request of the tenant: 429). At 248 it was stored, and each replay, which
    nests it two levels deeper, was a 500."""
    payload = {
        "model": "logprob-llm",
        "messages": [{"role": "user", "content": "Call f."}],
        "temperature": 0,
        "deep": levels,
    }
    auth = {"authorization": f"Bearer {KEY}"}
    first = httpx.post(url + "/v1/chat/completions", json=payload, headers=auth, timeout=10)
    again = httpx.post(url + "/v1/chat/completions", json=payload, headers=auth, timeout=10)
    assert (first.status_code, first.content) == (200, deep_answer(levels))
    assert (again.status_code, again.headers["x-tokenweir-cache"]) == (200, "miss")


def test_a_whole_answer_orjson_refuses_is_relayed_but_not_cached(url: str) -> None:
    """Python's reader takes a lone surrogate's escape (it is relayed as it came), read as
    U+FFFD: it was stored so, and the hit answered 'hi \ufffd' where the backend said '\\ud83d'."""
    reply = {"role": "assistant", "content": "hi ?"}
    first = converse(url, reply, stream=False, surrogate=True)
    assert first.status_code == 200
    assert b'"content":"hi \\ud83d"' in first.content
    again = converse(url, reply, stream=False, surrogate=True)
    assert again.headers["x-tokenweir-cache"] == "miss"
    assert again.content == first.content
