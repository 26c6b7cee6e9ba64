"""A client that leaves stops the backend: the upstream request is closed at once."""

from __future__ import annotations

import logging
import socket
import time
from typing import Literal

import httpx
import orjson
import pytest

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.tools.background import BackgroundServer
from tests.conftest import ALPHA_KEY, BACKEND_KEY, BETA_KEY, make_policy, policy_text
from tests.servers import serve, told_to_send

AUTH = {"authorization": f"Bearer {ALPHA_KEY}"}
LONG = {
    "model": "mock-llm",
    "messages": [{"role": "user", "content": "Write a very long story."}],
    "max_tokens": 20_000,
    "mock_completion_tokens": 20_000,
}


def wait_for_stat(backend: httpx.Client, name: str, value: int, within_s: float) -> float:
    """Seconds until the backend's counter `name` reached `value`; fails after `within_s`."""
    started = time.perf_counter()
    while True:
        seen = backend.get("/mock/stats").json()[name]
        elapsed_s = time.perf_counter() - started
        if seen >= value:
            return elapsed_s
        assert elapsed_s < within_s, f"{name} is {seen} after {elapsed_s * 1000:.0f} ms"
        time.sleep(0.002)


def access_records(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "tokenweir.access"]


def test_client_abort_mid_stream_cancels_backend_within_100ms(
    gateway_url: str, backend: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    body = {**LONG, "stream": True}
    with httpx.Client(base_url=gateway_url, timeout=10) as http:
        with http.stream("POST", "/v1/chat/completions", json=body, headers=AUTH) as answer:
            lines = answer.iter_lines()
            received = [next(lines) for _ in range(20)]
            assert all(line.startswith("data:") or not line for line in received)
            answer.close()  # drops the connection: the stream was not read to the end
            wait_for_stat(backend, "streams_cancelled", 1, within_s=0.1)
    stats = backend.get("/mock/stats").json()
    assert stats["streams_completed"] == 0
    assert stats["tokens_sent"] < 20_000
    deadline = time.monotonic() + 2
    while not access_records(caplog) and time.monotonic() < deadline:
        time.sleep(0.01)
    record = access_records(caplog)[-1]
    assert record["client_disconnected"] is True
    assert record["completed"] is False
    assert isinstance(record["output_tokens"], int)
    assert record["output_tokens"] > 0


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_a_client_that_leaves_is_seen_under_uvicorns_own_protocols(
    backend_url: str, backend: httpx.Client, http: Literal["h11", "httptools"]
) -> None:
    """Under `tokenweir serve` the connection itself tells the request that its client left;
    under a server that lends no response cycle (uvicorn's own protocols here, any ASGI server)
    a task waiting on `receive` for `http.disconnect` does, with the same effect."""
    app = create_app(make_policy(backend_url))
    with BackgroundServer(app, http=http) as url, httpx.Client(base_url=url, timeout=10) as client:
        body = {**LONG, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body, headers=AUTH) as answer:
            lines = answer.iter_lines()
            assert next(lines).startswith("data:")
            answer.close()
            wait_for_stat(backend, "streams_cancelled", 1, within_s=5)
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/chat/completions", json=LONG, headers=AUTH, timeout=0.3)
        wait_for_stat(backend, "requests_cancelled", 1, within_s=5)
    assert backend.get("/mock/stats").json()["streams_completed"] == 0


def test_client_abort_of_non_stream_request_cancels_backend(
    gateway_url: str, backend: httpx.Client
) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gateway_url + "/v1/chat/completions", json=LONG, headers=AUTH, timeout=0.3)
    wait_for_stat(backend, "requests_cancelled", 1, within_s=0.5)
    assert backend.get("/mock/stats").json()["inflight"] == 0


def test_a_client_that_leaves_a_whole_answer_midway_is_billed_its_prompt(
    gateway_url: str, backend: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    """A non-stream answer's head comes with its body: a client that left while the backend
    worked on it (prefill and some output) was billed nothing, so leaving just before the end
    used the backend outside every token quota."""
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    body = orjson.dumps(LONG)
    host, port = gateway_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as client:
        client.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\n"
            b"authorization: " + AUTH["authorization"].encode() + b"\r\n"
            b"content-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(body), body)
        )
        wait_for_stat(backend, "inflight", 1, within_s=10)  # the backend works on it: leave
    wait_for_stat(backend, "requests_cancelled", 1, within_s=10)
    deadline = time.monotonic() + 5
    while not access_records(caplog) and time.monotonic() < deadline:
        time.sleep(0.01)
    record = access_records(caplog)[-1]
    assert record["client_disconnected"] is True
    assert record["usage_source"] == "estimated"  # mock-llm has no tokenizer
    assert isinstance(record["input_tokens"], int)
    assert record["input_tokens"] > 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_client_that_leaves_with_a_request_pipelined_stops_the_backend(
    gateway_url: str, backend: httpx.Client, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    """With a second request pipelined behind the first, the server marked only the second as
    left: a whole answer's backend worked on to its end (10 s here), a stream wrote on to the
    closed connection until the write raised, an error traceback, and neither was recorded as
    the client's leaving."""
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    body = orjson.dumps({**LONG, "stream": stream})
    request_id = f"pipelined-{'stream' if stream else 'whole'}"
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\n"
        b"authorization: " + AUTH["authorization"].encode() + b"\r\n"
        b"content-type: application/json\r\nx-request-id: " + request_id.encode() + b"\r\n"
    )
    small = orjson.dumps({**LONG, "max_tokens": 1})
    host, port = gateway_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as client:
        client.sendall(
            head + b"content-length: %d\r\n\r\n%b" % (len(body), body)
            + head + b"content-length: %d\r\n\r\n%b" % (len(small), small)
        )  # fmt: skip
        if stream:
            wait_for_stat(backend, "streams_started", 1, within_s=10)
        else:
            wait_for_stat(backend, "inflight", 1, within_s=10)
    wait_for_stat(backend, "streams_cancelled" if stream else "requests_cancelled", 1, within_s=2)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        records = [r for r in access_records(caplog) if r["request_id"] == request_id]
        if records:
            break
        time.sleep(0.01)
    [record] = records  # the first: the second was never started
    assert record["client_disconnected"] is True
    assert record["completed"] is False
    assert not [r for r in caplog.records if "Exception in ASGI application" in r.getMessage()]


def test_a_client_that_leaves_a_request_with_a_large_body_stops_the_backend(
    backend_url: str, backend: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    """uvicorn stops reading a connection while more than 64 KiB of body waits for the app, and
    only the app's next `receive` reads on: a body whose last read took it past that left the
    connection unread, so a client that left while the backend had yet to answer was never
    seen to leave, and the backend worked on, with the tenant's slot held, until the read
    timeout (30 s here) ended the request as a 504. How a body is cut into reads is the
    kernel's: a few requests, so that one at least has such a last read."""
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    text = policy_text(backend_url, read_timeout="30s").replace("64KiB", "1MiB")
    environ = {"BACKEND_KEY": BACKEND_KEY, "BETA_KEY": BETA_KEY}
    policy = parse_policy(text, file="test.yaml", environ=environ)
    prompt = "word " * 50_000  # 250 kB, sent at once: it comes in one read or a few large ones
    request = {**LONG, "messages": [{"role": "user", "content": prompt}]}
    body = orjson.dumps({**request, "mock_delay_ms": 30_000})  # no byte of an answer for 30 s
    tries = 6
    with serve(create_app(policy)) as url:
        host, port = url.removeprefix("http://").split(":")
        for left in range(1, tries + 1):
            with socket.create_connection((host, int(port)), timeout=10) as client:
                # Told to send it once the gateway waits for it: the whole body comes at once.
                told_to_send(client, AUTH["authorization"], len(body))
                client.sendall(body)
                wait_for_stat(backend, "requests_total", left, within_s=10)  # it has it: leave
            wait_for_stat(backend, "requests_cancelled", left, within_s=10)
        deadline = time.monotonic() + 5
        while len(access_records(caplog)) < tries and time.monotonic() < deadline:
            time.sleep(0.01)
    records = access_records(caplog)
    assert [(r["status"], r["client_disconnected"]) for r in records] == [(499, True)] * tries
