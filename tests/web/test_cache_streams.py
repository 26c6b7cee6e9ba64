"""Long streams through the cache: stored as they pass, replayed exactly, with `log_content` too
(a hit's answer logged as the miss's was)."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy.app import create_app
from tests.conftest import ALPHA_KEY
from tests.servers import serve
from tests.stages.test_account import records
from tests.web.test_cache import QUESTION, backend_requests, cache_policy, sdk

# Thousands of chunks: the mock backend writes one event per token.
TOKENS = 3000


def streamed(client: openai.OpenAI, **body: Any) -> tuple[str, str, Any, str]:
    """The text, finish reason and usage of a streamed answer, and its cache header."""
    raw = client.chat.completions.with_raw_response.create(
        model="mock-llm",
        messages=QUESTION,  # type: ignore[arg-type]
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"mock_completion_tokens": TOKENS},
        **body,
    )
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    return text, str(finish), chunks[-1].usage, raw.headers["x-tokenweir-cache"]


def test_a_long_stream_is_stored_and_replayed_exactly(
    backend_url: str, backend: httpx.Client, redis_url: str
) -> None:
    with serve(create_app(cache_policy(backend_url, redis_url, "{mode: exact}"))) as url:
        with sdk(url) as client:
            miss, hit = streamed(client), streamed(client)
            whole = client.chat.completions.with_raw_response.create(
                model="mock-llm",
                messages=QUESTION,  # type: ignore[arg-type]
                temperature=0,
                extra_body={"mock_completion_tokens": TOKENS},
            )
    assert backend_requests(backend) == 1
    assert (miss[3], hit[3], whole.headers["x-tokenweir-cache"]) == ("miss", "hit", "hit")
    assert hit[:3] == miss[:3]
    assert len(miss[0].split()) == miss[2].completion_tokens == TOKENS
    answer = whole.parse()
    assert answer.choices[0].message.content == miss[0]
    assert (answer.choices[0].finish_reason, answer.usage) == (miss[1], miss[2])


def test_a_stream_is_stored_while_its_content_is_logged(
    backend_url: str, backend: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    policy = cache_policy(backend_url, "memory", "{mode: exact}")
    with serve(create_app(policy.model_copy(update={"log_content": True}))) as url:
        with sdk(url) as client:
            miss, hit = streamed(client), streamed(client)
            whole = client.chat.completions.create(
                model="mock-llm",
                messages=QUESTION,  # type: ignore[arg-type]
                temperature=0,
                extra_body={"mock_completion_tokens": TOKENS},
            )
    assert (miss[3], hit[3]) == ("miss", "hit")
    assert hit[:3] == miss[:3]
    assert backend_requests(backend) == 1
    logged = records(caplog, 3)
    assert [line["cache"] for line in logged] == ["miss", "hit", "hit"]
    assert logged[0]["completion"] == miss[0]  # what `log_content` logged, as without the cache
    # A hit's answer is logged too, streamed or whole (it was null: no bytes came from a backend)
    assert [line["completion"] for line in logged[1:]] == [hit[0], whole.choices[0].message.content]


def _cut_character_backend() -> Starlette:
    """A backend (an old llama.cpp's way) that sends an emoji's four bytes in two events."""
    emoji = "🙂".encode()
    pieces = [b"Hi ", b"there ", emoji[:2], emoji[2:], b"!"]

    head = b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"mock-llm",'

    def event(delta: bytes, finish: bytes = b"null") -> bytes:
        choice = b'{"index":0,"delta":' + delta + b',"finish_reason":' + finish + b"}"
        return head + b'"choices":[' + choice + b"]}\n\n"

    body = b"".join(
        [*(event(b'{"content":"' + piece + b'"}') for piece in pieces), event(b"{}", b'"stop"')]
    )

    async def chat(request: Request) -> Response:
        await request.body()
        return Response(body + b"data: [DONE]\n\n", media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def test_a_character_cut_across_events_is_relayed_as_sent_and_never_replayed_whole() -> None:
    """The stream was stored with the emoji whole: a hit replayed 🙂 where the backend's stream
    (which the openai SDK cannot even read) had two broken halves."""
    with serve(_cut_character_backend()) as backend_url:
        with serve(create_app(cache_policy(backend_url, "memory", "{mode: exact}"))) as url:
            payload = {"model": "mock-llm", "messages": QUESTION, "temperature": 0, "stream": True}
            auth = {"authorization": f"Bearer {ALPHA_KEY}"}
            first, second = (
                httpx.post(url + "/v1/chat/completions", json=payload, headers=auth)
                for _ in range(2)
            )
    assert (first.headers["x-tokenweir-cache"], second.headers["x-tokenweir-cache"]) == (
        "miss",
        "miss",
    )
    assert second.content == first.content
    assert b'"content":"\xf0\x9f"' in first.content
