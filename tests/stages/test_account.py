"""The access log: one JSON line per request, with timings and tokens, never prompts or keys."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from proxy.app import create_app
from proxy.ledger import UsageRecord, open_ledger
from proxy.stages.account import _ms, _round
from tests.conftest import ALPHA_KEY, BACKEND_KEY, BETA_KEY, make_policy, policy_text
from tests.servers import free_port, serve, wait_healthy

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


def ledger_records(path: Path) -> list[UsageRecord]:
    async def read() -> list[UsageRecord]:
        ledger = open_ledger(f"sqlite:///{path}", read_only=True)
        await ledger.start()
        try:
            return await ledger.latest(None, 100)
        finally:
            await ledger.aclose()

    return asyncio.run(read())


def test_every_request_reaches_the_ledger_and_report_agrees(
    backend_url: str, tmp_path: Path
) -> None:
    db = tmp_path / "usage.db"
    policy = make_policy(backend_url).model_copy(update={"ledger": f"sqlite:///{db}"})
    with serve(create_app(policy)) as url:
        with openai.OpenAI(base_url=url + "/v1", api_key=ALPHA_KEY, max_retries=0) as sdk:
            sdk.chat.completions.create(
                model="mock-llm", messages=[{"role": "user", "content": "hi"}], max_tokens=10
            )
            list(sdk.chat.completions.create(
                model="mock-llm", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                stream=True,
            ))  # fmt: skip
        httpx.post(url + "/v1/chat/completions", json={}, headers={"authorization": "Bearer no"})
    records = sorted(ledger_records(db), key=lambda r: r.ts)
    assert [(r.tenant, r.status, r.stream) for r in records] == [
        ("alpha", 200, False),
        ("alpha", 200, True),
        (None, 401, False),
    ]
    assert [r.output_tokens for r in records] == [10, 5, 0]
    # mock-llm costs 0.1 USD per 1M input and 0.4 per 1M output tokens: 4 nano-USD per output.
    assert records[0].cost_nusd == records[0].input_tokens * 100 + 10 * 400
    report = subprocess.run(
        [sys.executable, "-m", "proxy", "report", "--ledger", f"sqlite:///{db}",
         "--format", "json"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    rows = {row["tenant"]: row for row in orjson.loads(report.stdout)["rows"]}
    assert rows["alpha"]["requests"] == 2
    assert rows["alpha"]["output_tokens"] == 15


def test_sigterm_during_streams_loses_no_ledger_record(backend_url: str, tmp_path: Path) -> None:
    db = tmp_path / "usage.db"
    config = tmp_path / "policy.yaml"
    config.write_text(policy_text(backend_url) + f"\nledger: sqlite:///{db}\n")
    port = free_port()
    env = {**os.environ, "BACKEND_KEY": BACKEND_KEY, "BETA_KEY": BETA_KEY}
    command = [sys.executable, "-m", "proxy", "serve", "--config", str(config), "--port", str(port)]
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server)
        started = threading.Barrier(9)

        def stream() -> None:
            body = {"model": "mock-llm", "stream": True, "max_tokens": 1500,
                    "mock_completion_tokens": 1500,
                    "messages": [{"role": "user", "content": "long"}]}  # fmt: skip
            headers = {"authorization": f"Bearer {ALPHA_KEY}"}
            with httpx.stream(
                "POST", url + "/v1/chat/completions", json=body, headers=headers
            ) as r:
                lines = r.iter_lines()
                next(lines)
                started.wait(timeout=10)
                for _ in lines:
                    pass

        threads = [threading.Thread(target=stream) for _ in range(8)]
        for thread in threads:
            thread.start()
        started.wait(timeout=10)
        server.send_signal(signal.SIGTERM)  # while all eight streams are mid-way
        for thread in threads:
            thread.join(timeout=30)
        # uvicorn drains, shuts the lifespan down, then re-raises the signal it caught.
        assert server.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        if server.poll() is None:
            server.kill()
        server.communicate(timeout=30)  # closes the pipe
    records = ledger_records(db)
    assert len(records) == 8
    assert all(r.status == 200 and r.output_tokens > 0 for r in records)


def test_the_line_names_the_key_by_id_the_user_and_the_tags(
    client: openai.OpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    client.chat.completions.create(
        model="mock-llm",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        user="ann",
        extra_headers={"x-tokenweir-tags": "search,beta"},
    )
    [record] = records(caplog, 1)
    digest = hashlib.sha256(ALPHA_KEY.encode()).hexdigest()
    assert record["key_id"] == "sha256:" + digest[:12]
    assert (record["user"], record["tags"]) == ("ann", ["search", "beta"])
    line = caplog.records[-1].getMessage()
    assert ALPHA_KEY not in line
    assert digest not in line  # a prefix names the key; the whole hash is not logged


def test_timings_are_rounded_to_the_microsecond_as_decimal_rounding_would() -> None:
    """The ledger's and the access line's milliseconds (`_ms`) and tokens a second (`_round`)
    round as Python's `round(x, digits)` does, which they replaced for speed."""
    assert [_ms(None), _round(None)] == [None, None]
    assert [_ms(0.0123456), _ms(1.5), _ms(0.0)] == [12.346, 1500.0, 0.0]
    assert [_round(749.96), _round(12.34)] == [750.0, 12.3]
    draw = random.Random(7)  # noqa: S311  # test data, not secrets
    for _ in range(20_000):
        seconds = draw.random() * draw.choice((1e-4, 1e-2, 1.0, 100.0, 10_000.0))
        assert _ms(seconds) == round(seconds * 1000.0, 3), seconds
        rate = draw.random() * 5_000.0
        assert _round(rate) == round(rate, 1), rate
