"""A request's Host header and its asterisk target, over raw sockets to a real gateway on the
server `tokenweir serve` runs: HTTP/1.1 without exactly one Host is a 400 in OpenAI's shape that
never reaches the backend (RFC 9112 3.2); `OPTIONS *` is answered for the server as a whole."""

from __future__ import annotations

import httpx
import orjson
import pytest

from tests.conftest import ALPHA_KEY
from tests.reliability.test_client_framing import _responses
from tests.reliability.test_timeouts import _connect, _read_all

BODY = orjson.dumps({"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]})


def _chat(hosts: bytes) -> bytes:
    """A chat request with the key, its body and `hosts` (whole header lines, or none)."""
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\n%bauthorization: Bearer %b\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
        % (hosts, ALPHA_KEY.encode(), len(BODY), BODY)
    )


def _exchange(gateway_url: str, raw: bytes) -> list[tuple[int, bytes, bytes]]:
    with _connect(int(gateway_url.rsplit(":", 1)[1])) as sock:
        sock.sendall(raw)
        return _responses(_read_all(sock))  # until the gateway closes the connection


@pytest.mark.parametrize("hosts", [b"", b"host: a\r\nhost: b\r\n"], ids=["none", "two"])
def test_http11_without_exactly_one_host_is_refused(
    gateway_url: str, backend: httpx.Client, hosts: bytes
) -> None:
    [(status, head, body)] = _exchange(gateway_url, _chat(hosts))
    assert status == 400  # before: 200, the chat ran
    assert orjson.loads(body)["error"]["code"] == "invalid_host_header"
    assert b"connection: close" in head.lower()
    assert backend.get("/mock/stats").json()["requests_total"] == 0


def test_the_refusal_comes_after_the_answer_owed_before_it(gateway_url: str) -> None:
    answers = _exchange(gateway_url, _chat(b"host: x\r\n") + _chat(b""))
    assert [status for status, _, _ in answers] == [200, 400]


def test_http10_may_send_no_host(gateway_url: str) -> None:
    request = b"GET /healthz HTTP/1.0\r\n\r\n"
    [(status, _, body)] = _exchange(gateway_url, request)
    assert (status, orjson.loads(body)) == (200, {"status": "ok"})


def test_options_asterisk_asks_about_the_server(gateway_url: str) -> None:
    request = b"OPTIONS * HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    [(status, head, body)] = _exchange(gateway_url, request)
    assert (status, body) == (200, b"")  # before: a 404 for the path "/*"
    assert b"allow: GET, HEAD, POST, DELETE, OPTIONS" in head
    request = b"GET * HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    [(status, _, body)] = _exchange(gateway_url, request)
    assert status == 400
    assert orjson.loads(body)["error"]["code"] == "invalid_request_target"
