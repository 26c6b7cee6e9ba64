"""What the gateway's timings cover, judged against backends whose pace the test set: TTFT is
a stream's (a whole answer has no first token to time), and a wait in the tenant's line is the
request's time, not the gateway's own, as is a slow client's upload."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
import orjson
import pytest

from proxy.app import create_app
from proxy.policy import Policy, parse_policy
from proxy.policy.units import hash_key
from proxy.tools.mock import backend as mockbackend
from tests.conftest import ADMIN_KEY, ALPHA_KEY
from tests.servers import serve
from tests.telemetry.scripted import Script, chunk, scripted_backend, usage_chunk
from tests.telemetry.test_ground_truth import histogram

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def _policy(backend_url: str, ledger: Path, limits: str = "{}") -> Policy:
    return parse_policy(
        f"""
storage: memory
admin_keys: [{hash_key(ADMIN_KEY)}]
ledger: sqlite:///{ledger}
backends:
  - {{name: mock, url: {backend_url}/v1, models: [mock-llm, mock-embed]}}
models: {{mock-llm: {{}}, mock-embed: {{}}}}
tenants:
  alpha:
    api_keys: [{hash_key(ALPHA_KEY)}]
    models: [mock-llm, mock-embed]
    limits: {limits}
    cache: {{mode: exact}}
""",
        file="timings.yaml",
    )


def _access_lines(caplog: pytest.LogCaptureFixture, count: int) -> list[dict[str, Any]]:
    """The first `count` access lines, once written (after each answer's end)."""
    deadline = time.monotonic() + 10
    while True:
        lines = [r.getMessage() for r in caplog.records if r.name == "tokenweir.access"]
        if len(lines) >= count:
            return [orjson.loads(line) for line in lines[:count]]
        assert time.monotonic() < deadline, lines
        time.sleep(0.01)


def _usage_rows(url: str, requests: int) -> list[dict[str, Any]]:
    """/api/usage's hourly rows, once the ledger holds `requests` records."""
    deadline = time.monotonic() + 10
    while True:
        answer = httpx.get(url + "/api/usage?since=1d", headers=ADMIN).json()
        if answer["total"]["requests"] >= requests:
            rows: list[dict[str, Any]] = answer["data"]
            return rows
        assert time.monotonic() < deadline, answer
        time.sleep(0.05)


@pytest.fixture
def slow_whole_answers(tmp_path: Path) -> Iterator[str]:
    """A gateway with a ledger and the exact cache over the mock backend: first token at 0.2 s,
    then 20 tokens/s, so a whole answer of 40 tokens takes 2.2 s."""
    app = mockbackend.create_app(ttft_ms=200, tokens_per_second=20)
    with serve(app) as backend, serve(create_app(_policy(backend, tmp_path / "l.db"))) as url:
        yield url


def test_ttft_is_a_streams_never_a_whole_answers(
    slow_whole_answers: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream whose first token comes at 0.2 s and its cache hit, two whole answers of 2.2 s,
    a whole answer's cache hit and an embedding: the ledger's TTFT (access line, /api/usage,
    dashboard, report) is the streams'. A whole answer's 'TTFT' was its whole time and an
    embedding's its call, which no token ends, so the hour's TTFT p95 read 2.2 s where
    /metrics' (streams only) read 0.2 s."""
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    url = slow_whole_answers
    with openai.OpenAI(base_url=url + "/v1", api_key=ALPHA_KEY, max_retries=0) as sdk:

        def ask(text: str, stream: bool, max_tokens: int = 40) -> None:
            answer = sdk.chat.completions.create(
                model="mock-llm", messages=[{"role": "user", "content": text}],
                max_tokens=max_tokens, temperature=0, stream=stream,
            )  # fmt: skip
            if stream:
                list(answer)  # type: ignore[arg-type]

        for _ in range(2):  # then a cache hit
            ask("a stream", True, 5)
        for _ in range(2):
            ask("a whole answer", False)
        ask("another whole answer", False)
        sdk.embeddings.create(model="mock-embed", input="hi")
    lines = _access_lines(caplog, 6)
    assert [line["stream"] for line in lines] == [True, True, False, False, False, False]
    assert [line["cache"] for line in lines[:4]] == ["miss", "hit", "miss", "hit"], lines
    assert 150 < lines[0]["ttft_ms"] < 1500, lines[0]
    assert lines[1]["ttft_ms"] is not None, lines[1]  # the replayed stream's first token
    assert min(lines[i]["duration_ms"] for i in (2, 4)) > 2000, lines  # as paced
    assert [line["ttft_ms"] for line in lines[2:]] == [None] * 4, lines
    rows = _usage_rows(url, 6)
    timed = [row for row in rows if row["ttft_ms_p95"] is not None]
    assert len(timed) == 1, rows  # the streams' hour only
    assert timed[0]["ttft_ms_p95"] < 1500, rows  # the streams' 0.2 s (whole answers: 2.2 s)


def test_a_wait_in_line_is_no_gateway_overhead(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """max_concurrent 1 with a queue: the second stream waits in line until the first ends,
    2 s after its first token. The wait is in its TTFT and duration, as the client saw them,
    but not in `gateway_ms` and `tokenweir_gateway_overhead_seconds` (the gateway's own
    time), which read the whole wait as the gateway's (over 1.5 s of a few ms)."""
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    ending = [chunk({}, "stop"), usage_chunk(5, 1), b"data: [DONE]\n\n"]
    scripts: dict[str, Script] = {
        "first": [chunk({"content": "a"}), 2.0, *ending],
        "second": [chunk({"content": "b"}), *ending],
    }
    limits = "{max_concurrent: 1, queue_timeout: 30s}"
    with (
        serve(scripted_backend(scripts)) as backend,
        serve(create_app(_policy(backend, tmp_path / "l.db", limits))) as url,
        openai.OpenAI(base_url=url + "/v1", api_key=ALPHA_KEY, max_retries=0) as sdk,
    ):
        holding = threading.Event()

        def stream(text: str) -> None:
            messages = [{"role": "user", "content": text}]
            for part in sdk.chat.completions.create(
                model="mock-llm",
                messages=messages,
                stream=True,  # type: ignore[arg-type]
            ):
                if part.choices and part.choices[0].delta.content:
                    holding.set()

        first = threading.Thread(target=stream, args=("first",))
        first.start()
        assert holding.wait(30)  # the first holds the slot: its token is read
        stream("second")
        first.join()
        overhead = histogram(url, "tokenweir_gateway_overhead_seconds")
    [queued] = [line for line in _access_lines(caplog, 2) if line["ttft_ms"] > 1000]
    assert queued["gateway_ms"] < 500, queued  # its own few ms; the wait was 1.5-2 s
    assert overhead[0] == 2
    assert overhead[1] < 1.0, overhead  # both requests' own time, no wait in line


def test_a_slow_upload_is_no_gateway_overhead(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that sends its body's last bytes 2 s after its headers: the wait is in its
    TTFT and duration (counted from its headers, as before), not in `gateway_ms`, which read
    the whole upload as the gateway's own time."""
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    scripts: dict[str, Script] = {"upload": [chunk({"content": "a"}), b"data: [DONE]\n\n"]}
    body = orjson.dumps(
        {"model": "mock-llm", "stream": True, "messages": [{"role": "user", "content": "upload"}]}
    )
    with (
        serve(scripted_backend(scripts)) as backend,
        serve(create_app(_policy(backend, tmp_path / "l.db"))) as url,
    ):
        address = urlsplit(url)
        with socket.create_connection((address.hostname, address.port)) as client:
            client.sendall(_request(body)[: 10 - len(body)])  # all but the body's last bytes
            time.sleep(2.0)
            client.sendall(body[10:])
            answer = b""
            while b"[DONE]" not in answer:
                read = client.recv(65536)
                assert read, answer
                answer += read
    [line] = _access_lines(caplog, 1)
    assert line["status"] == 200, line
    assert line["ttft_ms"] > 1900, line  # from the headers: the upload is the client's wait
    assert line["gateway_ms"] < 1000, line  # its own few ms; the upload took 2 s


def test_a_client_that_stops_reading_is_no_gateway_overhead(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A client with a small receive buffer that reads nothing for 2 s of a 6 MB stream: the
    gateway's writes wait for it (its socket full). That wait is the client's: in the gaps and
    duration as it read them, not in `gateway_ms`, which read it as the gateway's own time."""
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    many = chunk({"content": "w" * 300}) * 200  # about 70 KB a write
    scripts: dict[str, Script] = {"big": [many] * 90 + [b"data: [DONE]\n\n"]}
    body = orjson.dumps(
        {"model": "mock-llm", "stream": True, "messages": [{"role": "user", "content": "big"}]}
    )
    with (
        serve(scripted_backend(scripts)) as backend,
        serve(create_app(_policy(backend, tmp_path / "l.db"))) as url,
        socket.socket() as client,
    ):
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        address = urlsplit(url)
        client.connect((address.hostname, address.port))
        client.sendall(_request(body))
        answer = client.recv(4096)
        time.sleep(2.0)
        while b"[DONE]" not in answer[-64:]:
            read = client.recv(1 << 20)
            assert read, answer[-200:]
            answer += read
    [line] = _access_lines(caplog, 1)
    assert line["duration_ms"] > 1500, line  # the gateway waited for the client to read
    assert line["gateway_ms"] < 1000, line  # its own time; the client's 2 s are not


def _request(body: bytes) -> bytes:
    """A chat request of alpha's with `body`, as a raw client writes it."""
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
        b"Authorization: Bearer " + ALPHA_KEY.encode() + b"\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    )
