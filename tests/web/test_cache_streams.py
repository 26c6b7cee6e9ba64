"""Long streams through the cache: stored as they pass, replayed exactly, with `log_content` too
(a hit's answer logged as the miss's was)."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import openai
import pytest

from proxy.app import create_app
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
