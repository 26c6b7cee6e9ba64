"""The access log: one JSON line per request, with timings and tokens, never prompts or keys."""

from __future__ import annotations

import logging
import time

import httpx
import openai
import orjson
import pytest

from tests.conftest import ALPHA_KEY

SECRET_PROMPT = "my-confidential-prompt-7731"


def records(caplog: pytest.LogCaptureFixture, count: int) -> list[dict[str, object]]:
    deadline = time.monotonic() + 2
    while True:
        found = [
            orjson.loads(r.getMessage()) for r in caplog.records if r.name == "tokenweir.access"
        ]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.01)


def test_one_line_per_request_with_stream_timings(
    client: openai.OpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    messages = [{"role": "user", "content": SECRET_PROMPT}]
    list(
        client.chat.completions.create(
            model="mock-llm", messages=messages, max_tokens=30, stream=True
        )
    )
    [record] = records(caplog, 1)
    assert record["tenant"] == "alpha"
    assert record["model"] == "mock-llm"
    assert record["backend"] == "mock-a"
    assert record["status"] == 200
    assert record["stream"] is True
    assert record["completed"] is True
    assert record["usage"] == "backend"
    assert record["output_tokens"] == 30
    assert isinstance(record["input_tokens"], int)
    for field in (
        "ttft_ms",
        "upstream_ttft_ms",
        "itl_p50_ms",
        "itl_p99_ms",
        "tokens_per_s",
        "gateway_ms",
    ):
        assert isinstance(record[field], float), field
    # 2,000 tokens/s configured in the simulated backend: the meter must see the same order.
    assert 500 < float(record["tokens_per_s"]) < 4000  # type: ignore[arg-type]
    assert float(record["gateway_ms"]) < float(record["duration_ms"])  # type: ignore[arg-type]
    line = caplog.records[-1].getMessage()
    assert SECRET_PROMPT not in line
    assert ALPHA_KEY not in line
    assert "\n" not in line


def test_rejected_requests_are_logged_too(
    gateway_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    body = {"model": "mock-llm", "messages": [{"role": "user", "content": SECRET_PROMPT}]}
    httpx.post(
        gateway_url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer nope"}
    )
    [record] = records(caplog, 1)
    assert record["status"] == 401
    assert record["error"] == "invalid_api_key"
    assert record["tenant"] is None
    assert "nope" not in caplog.records[-1].getMessage()
