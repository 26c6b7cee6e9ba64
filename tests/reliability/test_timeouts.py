"""Slow clients and slow backends, over raw sockets and HTTP: each gets an OpenAI-shaped 408 or 504
in time, and a stalled connection is closed rather than held."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from proxy.policy import PolicyError, parse_policy
from proxy.policy.units import hash_key
from proxy.tools.mock import backend as mockbackend
from tests.reliability.state import AUTH, KEY, policy_text
from tests.servers import replicas, serve

SERVER = "{header_timeout: 1s, body_timeout: 1s, keep_alive_timeout: 1s}"


@pytest.fixture(scope="module")
def gateway(backend_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A real `tokenweir serve` with one-second client timeouts; yields its port."""
    config = tmp_path_factory.mktemp("timeouts") / "policy.yaml"
    upstream = "{read_timeout: 1s}"
    config.write_text(policy_text(backend_url, "memory", server=SERVER, upstream=upstream))
    with replicas(config, 1) as [(_, url)]:
        yield int(url.rsplit(":", 1)[1])


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection (fails the test after 5 s)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def _read_response(sock: socket.socket) -> bytes:
    """One response with a content-length, however many packets it comes in."""
    received = b""
    while b"\r\n\r\n" not in received or len(received.partition(b"\r\n\r\n")[2]) < int(
        received.lower().split(b"content-length: ")[1].split(b"\r\n")[0]
    ):
        chunk = sock.recv(65536)
        assert chunk, f"closed before a whole response: {received!r}"
        received += chunk
    return received


def _status_and_error(raw: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, orjson.loads(body)["error"]


def _dribble_headers(sock: socket.socket) -> bytes:
    """A header every 0.1 s (for 10 s at most), until the gateway answers and closes."""
    answer = b""
    for i in range(100):
        try:
            sock.sendall(b"x-slow-%d: 1\r\n" % i)
        except (BrokenPipeError, ConnectionResetError):
            break
        time.sleep(0.1)
        sock.setblocking(False)
        try:
            answer += sock.recv(65536)
        except BlockingIOError:
            pass
        sock.setblocking(True)
    return answer


def test_a_client_that_never_sends_headers_gets_408_and_is_closed(gateway: int) -> None:
    with _connect(gateway) as sock:
        began = time.monotonic()
        status, error = _status_and_error(_read_all(sock))
    assert status == 408
    assert error["code"] == "request_timeout"
    assert 0.9 <= time.monotonic() - began < 3


def test_the_servers_own_refusals_carry_a_request_id(gateway: int) -> None:
    """Every answer carries `x-request-id`: the 408 and 431 the server gives before a request
    reaches the app had none."""
    with _connect(gateway) as sock:
        head = _read_all(sock).partition(b"\r\n\r\n")[0]
    assert head.startswith(b"HTTP/1.1 408")
    assert re.search(rb"\r\nx-request-id: req_[0-9a-f]{32}(\r\n|$)", head)


def test_slowloris_dribbling_headers_is_cut_at_the_header_timeout(gateway: int) -> None:
    with _connect(gateway) as sock:
        began = time.monotonic()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        answer = _dribble_headers(sock)
        assert time.monotonic() - began < 3
    assert answer.startswith(b"HTTP/1.1 408")


def test_headers_past_the_cap_get_431_and_are_closed(gateway: int) -> None:
    """A 20 MB header was taken whole, held in memory, and answered 200 (a client could send
    hundreds of MB a connection within the header deadline)."""
    with _connect(gateway) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-big: ")
        sent = 0
        try:
            while sent < 20_000_000:
                sock.sendall(b"v" * 65536)
                sent += 65536
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, error = _status_and_error(_read_all(sock))
    assert status == 431
    assert error["code"] == "request_headers_too_large"
    assert sent < 10_000_000  # cut early (what socket buffers took), not at its end
    with _connect(gateway) as sock:  # headers of a usual size are as before
        body = b'{"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]}'
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\n"
            b"x-fair: %s\r\ncontent-length: %d\r\n\r\n%s"
            % (KEY.encode(), b"v" * 30_000, len(body), body)
        )
        assert _read_response(sock).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize(
    "headers",
    [b"x-big: %s\r\n" % (b"v" * 70_000), b"".join(b"x-h%d: v\r\n" % i for i in range(9_000))],
    ids=["one 70 KB header", "9,000 small headers"],
)
def test_headers_past_the_cap_in_one_write_get_431(gateway: int, headers: bytes) -> None:
    """Headers that came whole in the read the request began in (a read takes up to 256 KiB)
    were never counted: 70 KB of them, or 9,000 small ones, were answered 200, past the 64 KiB
    the gateway refuses. A large body in the same read as a usual head is still served."""
    body = b'{"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]}'
    start = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\n" % (
        KEY.encode()
    )
    with _connect(gateway) as sock:
        sock.sendall(start + headers + b"content-length: %d\r\n\r\n%s" % (len(body), body))
        status, error = _status_and_error(_read_all(sock))
    assert status == 431
    assert error["code"] == "request_headers_too_large"
    padded = body + b" " * 150_000  # whitespace after the JSON: one read of ~150 KB
    with _connect(gateway) as sock:
        sock.sendall(start + b"content-length: %d\r\n\r\n%s" % (len(padded), padded))
        assert _read_response(sock).startswith(b"HTTP/1.1 200")


def test_a_later_request_dribbling_its_headers_on_a_kept_connection_is_cut(gateway: int) -> None:
    """The header deadline holds for every request of a connection, not only its first."""
    with _connect(gateway) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
        began = time.monotonic()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        answer = _dribble_headers(sock)
        assert time.monotonic() - began < 3
    assert answer.startswith(b"HTTP/1.1 408")


@pytest.mark.parametrize("sent", [b'{"model": ', b""], ids=["part-of-it", "none-of-it"])
def test_a_body_that_does_not_arrive_in_time_gets_408(gateway: int, sent: bytes) -> None:
    with _connect(gateway) as sock:
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {KEY}\r\ncontent-length: 1000\r\n\r\n"
        )
        sock.sendall(head.encode() + sent)
        began = time.monotonic()
        status, error = _status_and_error(_read_response(sock))
    assert status == 408
    assert error["code"] == "request_timeout"
    assert error["type"] == "invalid_request_error"
    assert 0.9 <= time.monotonic() - began < 3


def test_a_dashboard_login_form_that_does_not_arrive_in_time_gets_408(gateway: int) -> None:
    """The login form needs no key: trickled a byte at a time, it was waited for without end."""
    with _connect(gateway) as sock:
        sock.sendall(
            b"POST /dashboard/login HTTP/1.1\r\nhost: x\r\n"
            b"content-type: application/x-www-form-urlencoded\r\ncontent-length: 100\r\n\r\nkey="
        )
        began = time.monotonic()
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 408")
    assert 0.9 <= time.monotonic() - began < 3


def test_an_idle_keep_alive_connection_is_closed(gateway: int) -> None:
    with _connect(gateway) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
        began = time.monotonic()
        assert sock.recv(65536) == b""  # closed by the gateway, not by the test
        assert 0.9 <= time.monotonic() - began < 3


def test_a_backend_silent_before_its_first_byte_gets_504(gateway: int) -> None:
    body = orjson.dumps(
        {"model": "mock-llm", "messages": [{"role": "user", "content": "x"}], "stream": True,
         "mock_delay_ms": 3000}
    )  # fmt: skip
    with _connect(gateway) as sock:
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {KEY}\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n"
        )
        began = time.monotonic()
        sock.sendall(head.encode() + body)
        status, error = _status_and_error(_read_all(sock))
    assert status == 504
    assert error["code"] == "upstream_timeout"
    assert time.monotonic() - began < 2.5


def test_the_timeouts_are_policy_keys(tmp_path: Path, backend_url: str) -> None:
    """The keys above are part of the policy file; a bad value names the key."""
    text = policy_text(backend_url, "memory", server="{body_timeout: 0s}")
    with pytest.raises(PolicyError, match=r"server\.body_timeout"):
        parse_policy(text, environ={})
    text = policy_text(backend_url, "memory", upstream="{first_byte_timeout: 0s}")
    with pytest.raises(PolicyError, match=r"upstream\.first_byte_timeout"):
        parse_policy(text, environ={})


@pytest.fixture(scope="module")
def first_byte_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    """A `tokenweir serve` with `first_byte_timeout: 500ms` and `read_timeout: 30s` in front of
    two mock backends: one with a 2 s TTFT (twice, as slow-a and slow-b, for mock-llm; once as
    patient, whose own first_byte_timeout is 5 s, for mock-patient) and one whose first token
    comes after 0.1 s and each next one 0.625 s later (mock-steady). Yields the three URLs."""
    slow_app = mockbackend.create_app(ttft_ms=2000, tokens_per_second=2000)
    steady_app = mockbackend.create_app(ttft_ms=100, tokens_per_second=1.6)
    with serve(slow_app) as slow, serve(steady_app) as steady:
        config = tmp_path_factory.mktemp("first-byte") / "policy.yaml"
        config.write_text(f"""
storage: memory
upstream: {{read_timeout: 30s, first_byte_timeout: 500ms, circuit: {{failures: 100}}}}
backends:
  - {{name: slow-a, url: "{slow}/v1", models: [mock-llm]}}
  - {{name: slow-b, url: "{slow}/v1", models: [mock-llm]}}
  - {{name: patient, url: "{slow}/v1", models: [mock-patient], first_byte_timeout: 5s}}
  - {{name: steady, url: "{steady}/v1", models: [mock-steady]}}
models: {{mock-llm: {{}}, mock-patient: {{}}, mock-steady: {{}}}}
tenants:
  app: {{api_keys: [{hash_key(KEY)}], models: [mock-llm, mock-patient, mock-steady]}}
""")
        with replicas(config, 1) as [(_, url)]:
            yield url, slow, steady


def _chat(model: str, *, stream: bool, tokens: int = 3) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "x"}], "stream": stream,
            "max_tokens": tokens, "mock_completion_tokens": tokens}  # fmt: skip


def _wait_for(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_first_token_later_than_first_byte_timeout_gets_504_and_stops_the_backend(
    first_byte_gateway: tuple[str, str, str], stream: bool
) -> None:
    """Not after the 30 s read timeout, and not retried on slow-b: the backend may be generating."""
    gateway, slow, _ = first_byte_gateway
    with httpx.Client(base_url=slow) as mock:
        mock.post("/mock/stats/reset").raise_for_status()
        began = time.monotonic()
        answer = httpx.post(
            gateway + "/v1/chat/completions", json=_chat("mock-llm", stream=stream), headers=AUTH
        )
        elapsed_s = time.monotonic() - began
        assert answer.status_code == 504
        error = answer.json()["error"]
        assert (error["type"], error["code"]) == ("api_error", "upstream_timeout")
        assert "first-byte timeout" in error["message"]
        assert 0.45 <= elapsed_s < 10  # the 0.5 s first-byte timeout, far from the 30 s read one
        # The gateway closed the backend's connection: the mock saw its client leave.
        gone = "streams_cancelled" if stream else "requests_cancelled"
        _wait_for(lambda: mock.get("/mock/stats").json()[gone] == 1)
        assert mock.get("/mock/stats").json()["requests_total"] == 1


def test_a_slow_but_steady_stream_is_not_cut(first_byte_gateway: tuple[str, str, str]) -> None:
    """Its first token comes in time; the gaps after it (0.625 s) exceed first_byte_timeout."""
    gateway, _, _ = first_byte_gateway
    began = time.monotonic()
    body = _chat("mock-steady", stream=True)
    with httpx.stream(
        "POST", gateway + "/v1/chat/completions", json=body, headers=AUTH, timeout=10
    ) as answer:
        assert answer.status_code == 200
        events = [line for line in answer.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert sum('"content"' in event for event in events) >= 3
    assert time.monotonic() - began > 1.2


def test_a_backends_own_first_byte_timeout_overrides_the_shared_one(
    first_byte_gateway: tuple[str, str, str],
) -> None:
    gateway, _, _ = first_byte_gateway
    answer = httpx.post(
        gateway + "/v1/chat/completions",
        json=_chat("mock-patient", stream=False),
        headers=AUTH,
        timeout=10,
    )
    assert answer.status_code == 200
    assert answer.json()["usage"]["completion_tokens"] == 3


def test_the_protocol_docs_name_for_uvicorn_by_hand_is_the_one_serve_runs() -> None:
    """docs/operations.md: under uvicorn run by hand, `--http
    proxy.web.slowclient:HeaderTimeoutProtocol` gives the header deadline (and a stream's direct
    writes) that `tokenweir serve` has."""
    from proxy.asgi.protocol import HeaderTimeoutProtocol as served
    from proxy.web.slowclient import HeaderTimeoutProtocol as documented

    assert documented is served
