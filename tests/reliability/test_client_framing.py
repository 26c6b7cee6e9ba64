"""A hostile client's framing, over raw sockets to a real `tokenweir serve`: bytes that are not
HTTP/1.1 get an OpenAI-shaped 400 after the answers owed before them and never reach the backend;
a request refused before its body came cannot hold its connection by dribbling that body, nor
have its next request taken for that body."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from proxy.asgi.protocol import MAX_PIPELINED
from proxy.tools.mock import backend as mockbackend
from tests.reliability.state import KEY, policy_text
from tests.reliability.test_timeouts import _connect, _read_all
from tests.servers import replicas, serve

SERVER = "{header_timeout: 1s, body_timeout: 1s, keep_alive_timeout: 1s, max_body_bytes: 64KiB}"
BODY = orjson.dumps({"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]})
HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    b"authorization: Bearer " + KEY.encode() + b"\r\n"
)
CHAT = HEAD + b"content-length: %d\r\n\r\n%b" % (len(BODY), BODY)


@pytest.fixture(scope="module")
def backend() -> Iterator[str]:
    """A backend of this module's own, whose request count no other test moves."""
    with serve(mockbackend.create_app(ttft_ms=0, tokens_per_second=2000)) as url:
        yield url


@pytest.fixture(scope="module")
def served(backend: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    """A real `tokenweir serve` with one-second client timeouts; yields its port and pid."""
    config = tmp_path_factory.mktemp("framing") / "policy.yaml"
    config.write_text(policy_text(backend, "memory", server=SERVER))
    with replicas(config, 1) as [(process, url)]:
        yield int(url.rsplit(":", 1)[1]), process.pid


@pytest.fixture
def gateway(served: tuple[int, int]) -> int:
    return served[0]


def _backend_calls(backend: str) -> int:
    return int(httpx.get(backend + "/mock/stats").json()["requests_total"])


def _read_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """One response with a content-length: its head and body."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a whole response: {received!r}"
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a whole response: {received!r}"
        body += chunk
    return head, body


def _responses(raw: bytes) -> list[tuple[int, bytes, bytes]]:
    """Each response (status, head, body) of what came on a connection, bodies by length."""
    answers = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        answers.append((int(head.split(b" ", 2)[1]), head, rest[:length]))
        raw = rest[length:]
    return answers


MALFORMED = {
    "content-length-and-chunked": HEAD
    + b"content-length: %d\r\ntransfer-encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n\r\n"
    % (len(BODY), len(BODY), BODY),
    "two-content-lengths": HEAD
    + b"content-length: %d\r\ncontent-length: 5\r\n\r\n%b" % (len(BODY), BODY),
    "obsolete-line-folding": HEAD
    + b"x-folded: a\r\n b\r\ncontent-length: %d\r\n\r\n%b" % (len(BODY), BODY),
    "bad-chunk-size": HEAD + b"transfer-encoding: chunked\r\n\r\nzz\r\n%b\r\n0\r\n\r\n" % BODY,
    "odd-method": b"FOO /v1/chat/completions HTTP/1.1\r\nhost: x\r\n\r\n",
}


@pytest.mark.parametrize("raw", MALFORMED.values(), ids=MALFORMED.keys())
def test_bytes_that_are_not_http_get_an_openai_shaped_400(
    gateway: int, backend: str, raw: bytes
) -> None:
    """uvicorn answered them with a text/plain "Invalid HTTP request received.", which the
    OpenAI SDKs cannot read as an error."""
    calls = _backend_calls(backend)
    with _connect(gateway) as sock:
        sock.sendall(raw)
        [(status, head, body)] = _responses(_read_all(sock))
    assert status == 400
    assert b"content-type: application/json" in head.lower()
    assert re.search(rb"\r\nx-request-id: req_[0-9a-f]{32}\r\n", head + b"\r\n")
    error = orjson.loads(body)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_http_request"
    assert _backend_calls(backend) == calls


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_request_before_malformed_bytes_gets_its_own_answer_first(
    gateway: int, backend: str, stream: bool
) -> None:
    """A valid request with bytes that are not HTTP after it on the connection (pipelined) was
    answered uvicorn's 400 in its place, while the gateway called the backend for it."""
    body = orjson.dumps({"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]})
    if stream:
        body = body[:-1] + b', "stream": true}'
    calls = _backend_calls(backend)
    with _connect(gateway) as sock:
        sock.sendall(
            HEAD + b"content-length: %d\r\n\r\n%b" % (len(body), body) + b"GARBAGE\r\n\r\n"
        )
        raw = _read_all(sock)
    first, _, rest = raw.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200")
    if stream:
        answer, _, rest = rest.partition(b"\r\n0\r\n\r\n")  # the stream's last chunk
        assert b"data: [DONE]" in answer
    else:
        length = int(first.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        assert orjson.loads(rest[:length])["object"] == "chat.completion"
        rest = rest[length:]
    [(status, _, error)] = _responses(rest)
    assert status == 400
    assert orjson.loads(error)["error"]["code"] == "invalid_http_request"
    assert _backend_calls(backend) == calls + 1


def test_a_late_pipelined_request_is_refused_after_the_stream_before_it(gateway: int) -> None:
    """A request whose headers are late behind a stream (pipelined) is answered 408 once that
    stream has ended: the 408 was written into the middle of the stream, which it cut."""
    body = orjson.dumps(
        {
            "model": "mock-llm",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "mock_completion_tokens": 6000,  # 3 s at the backend's 2,000 tokens/s
        }
    )
    with _connect(gateway) as sock:
        sock.settimeout(15)
        sock.sendall(HEAD + b"content-length: %d\r\n\r\n%b" % (len(body), body))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")  # and no more
        raw = _read_all(sock)
    assert raw.startswith(b"HTTP/1.1 200")
    stream, end, rest = raw.partition(b"data: [DONE]\n\n\r\n0\r\n\r\n")  # its last chunk
    assert end, raw[-300:]
    assert b"HTTP/1.1 408" not in stream
    [(status, _, error)] = _responses(rest)
    assert status == 408
    assert orjson.loads(error)["error"]["code"] == "request_timeout"


REFUSED = {
    "401-bad-key": HEAD.replace(KEY.encode(), b"not-a-key") + b"content-length: 100000\r\n\r\n",
    "413-declared-too-large": HEAD + b"content-length: 10000000\r\n\r\n",
    "408-body-late": HEAD + b"content-length: 100000\r\n\r\n",
}


@pytest.mark.parametrize("raw", REFUSED.values(), ids=REFUSED.keys())
def test_a_refused_requests_body_dribbled_does_not_hold_the_connection(
    gateway: int, raw: bytes
) -> None:
    """Answered before its body came, a request's rest was read and dropped for as long as the
    client sent a byte now and then: no header, body or keep-alive deadline applied to it, so a
    client held the connection for ever."""
    with _connect(gateway) as sock:
        sock.sendall(raw)
        _, body = _read_response(sock)
        assert orjson.loads(body)["error"]["type"] == "invalid_request_error"
        began = time.monotonic()
        closed = False
        while not closed and time.monotonic() - began < 8:
            try:
                sock.sendall(b"x")
            except (BrokenPipeError, ConnectionResetError):
                break
            sock.settimeout(0.2)
            try:
                closed = sock.recv(65536) == b""
            except TimeoutError:
                pass
            except ConnectionResetError:
                closed = True
        assert time.monotonic() - began < 4  # the header deadline (1 s) after the answer


def test_a_refused_body_sent_whole_keeps_the_connection(gateway: int) -> None:
    """The rest of a refused body that does come in time is dropped, and the connection serves
    the next request."""
    with _connect(gateway) as sock:
        big = b"x" * 300_000
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n"
            % len(big)
        )
        sock.sendall(big)
        head, _ = _read_response(sock)
        assert head.startswith(b"HTTP/1.1 401")
        sock.sendall(CHAT)
        head, body = _read_response(sock)
    assert head.startswith(b"HTTP/1.1 200")
    assert orjson.loads(body)["object"] == "chat.completion"


@pytest.mark.parametrize("pieces", [1, 2], ids=["after-the-answer", "part-before-part-after"])
def test_a_refused_body_that_came_does_not_close_the_connection_later(
    gateway: int, pieces: int
) -> None:
    """A 401's body that came after its answer was taken for one still coming: the header
    deadline (1 s here) then closed the connection under whatever request it carried next (a
    client's next request on it cut with no answer, a stream cut mid-way)."""
    with _connect(gateway) as sock:
        body = b"x" * 1000
        sock.sendall(HEAD.replace(KEY.encode(), b"not-a-key") + b"content-length: 1000\r\n\r\n")
        if pieces == 2:
            sock.sendall(body[:500])
        head, _ = _read_response(sock)
        assert head.startswith(b"HTTP/1.1 401")
        sock.sendall(body[500:] if pieces == 2 else body)
        began = time.monotonic()
        while time.monotonic() - began < 3:  # past the header deadline; never idle for 1 s
            sock.sendall(CHAT)
            head, _ = _read_response(sock)
            assert head.startswith(b"HTTP/1.1 200")
            time.sleep(0.2)


def test_expect_100_continue_refused_closes_the_connection(gateway: int) -> None:
    """A request that asked `Expect: 100-continue` and was refused before it was told to send its
    body (413) does not send it; the connection was kept for a body that never came, and the
    client's next request on it was read as that body and never answered."""
    with _connect(gateway) as sock:
        sock.sendall(HEAD + b"expect: 100-continue\r\ncontent-length: 10000000\r\n\r\n")
        head, body = _read_response(sock)
        assert head.startswith(b"HTTP/1.1 413")
        assert b"\r\nconnection: close" in head.lower()
        assert orjson.loads(body)["error"]["code"] == "request_too_large"
        sock.settimeout(3)
        assert sock.recv(65536) == b""  # closed: the next request goes on a new connection


def test_expect_100_continue_with_its_body_keeps_the_connection(gateway: int) -> None:
    with _connect(gateway) as sock:
        sock.sendall(HEAD + b"expect: 100-continue\r\ncontent-length: %d\r\n\r\n" % len(BODY))
        assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(BODY)
        head, _ = _read_response(sock)
        assert head.startswith(b"HTTP/1.1 200")
        assert b"connection: close" not in head.lower()
        sock.sendall(CHAT)
        head, _ = _read_response(sock)
    assert head.startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_http_1_0_answer_has_no_chunked_framing(gateway: int, stream: bool) -> None:
    """HTTP/1.0 has no chunked framing: a stream went to an HTTP/1.0 client (`curl --http1.0`,
    an old proxy) with `transfer-encoding: chunked`, so it read the chunk sizes as part of the
    events. It now goes as it comes, ended by closing the connection."""
    body = orjson.dumps(
        {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    )
    with _connect(gateway) as sock:
        sock.sendall(
            HEAD.replace(b"HTTP/1.1", b"HTTP/1.0")
            + b"content-length: %d\r\n\r\n%b" % (len(body), body)
        )
        raw = _read_all(sock)
    head, _, answer = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding" not in head.lower()
    assert b"\r\nconnection: close" in head.lower()
    if not stream:
        assert orjson.loads(answer)["object"] == "chat.completion"
        return
    events = answer.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    chunks = [orjson.loads(event.removeprefix(b"data: ")) for event in events[:-2]]
    assert chunks
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)


H2C = (  # as curl --http2 sends it
    b"connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\n"
    b"http2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
)


@pytest.mark.parametrize("sent", ["one-read", "body-later", "chunked"])
def test_a_request_offering_h2c_is_answered_with_its_body(
    gateway: int, backend: str, sent: str
) -> None:
    """`curl --http2` on an http:// URL, Java's RestClient and Ktor offer `Upgrade: h2c` on a
    POST. The body never reached the gateway: a 400 `invalid_json` (a zero-length document), or
    uvicorn's 400 when the body came in a read of its own. The offer is ignored, as RFC 9110
    allows, and the request answered, its body as sent reaching the backend; the connection
    serves the next request."""
    question = f"h2c {sent}"
    body = orjson.dumps({"model": "mock-llm", "messages": [{"role": "user", "content": question}]})
    with _connect(gateway) as sock:
        if sent == "chunked":
            sock.sendall(
                HEAD
                + H2C
                + b"transfer-encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
            )
        else:
            sock.sendall(HEAD + H2C + b"content-length: %d\r\n\r\n" % len(body))
            if sent == "body-later":
                time.sleep(0.2)
            sock.sendall(body)
        head, answer = _read_response(sock)
        assert head.startswith(b"HTTP/1.1 200"), answer
        assert orjson.loads(answer)["object"] == "chat.completion"
        seen = httpx.get(backend + "/mock/stats").json()["last_request"]
        assert seen["messages"] == [{"role": "user", "content": question}]
        sock.sendall(CHAT)
        head, _ = _read_response(sock)
    assert head.startswith(b"HTTP/1.1 200")


def test_a_chunked_bodys_trailer_fields_are_not_request_headers(gateway: int) -> None:
    """Trailer fields after a chunked body joined the request's headers: a trailer's
    `authorization` authenticated the request (past a proxy that checks or strips the header
    section only), a trailer's `x-request-id` named it. They are dropped."""
    chunked = b"transfer-encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n" % (len(BODY), BODY)
    no_key = HEAD.replace(b"authorization: Bearer " + KEY.encode() + b"\r\n", b"")
    trailers = b"authorization: Bearer %b\r\nx-request-id: from-a-trailer\r\n\r\n" % KEY.encode()
    with _connect(gateway) as sock:
        sock.sendall(no_key + chunked + trailers)
        head, body = _read_response(sock)
        assert head.startswith(b"HTTP/1.1 401"), body
        assert orjson.loads(body)["error"]["code"] == "invalid_api_key"
        sock.sendall(HEAD + chunked + trailers)  # with the key where it belongs
        head, body = _read_response(sock)
    assert head.startswith(b"HTTP/1.1 200")
    assert orjson.loads(body)["object"] == "chat.completion"
    assert b"from-a-trailer" not in head


PIPELINED = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n"


def test_requests_pipelined_past_the_cap_get_a_400_after_the_answers_before(gateway: int) -> None:
    """Every request of a read was parsed and queued at once (a 256 KiB read holds 9,000 of
    them). Those within the cap, and the one being answered, get their answers; then a 400."""
    with _connect(gateway) as sock:
        sock.sendall(PIPELINED * 40)
        answers = _responses(_read_all(sock))
    statuses = [status for status, _, _ in answers]
    assert statuses[-1] == 400
    assert set(statuses[:-1]) == {200}
    assert MAX_PIPELINED + 1 <= len(statuses) - 1 < 40  # the first read may hold fewer
    error = orjson.loads(answers[-1][2])["error"]
    assert error["code"] == "too_many_pipelined_requests"


def test_pipelined_floods_do_not_grow_the_gateway(served: tuple[int, int]) -> None:
    """Twenty connections that each sent a read's worth of pipelined requests (5 MB in all)
    held 15-20 MB of the gateway's memory each (330 MB), and kept much of it."""
    port, pid = served

    def rss_bytes() -> int:
        with open(f"/proc/{pid}/status") as status:
            line = next(line for line in status if line.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024

    before = rss_bytes()
    flood = PIPELINED * (262_144 // len(PIPELINED))
    connections = [_connect(port) for _ in range(20)]
    try:
        for sock in connections:
            sock.sendall(flood)
        time.sleep(1)  # parsed, not read back
        assert rss_bytes() - before < 64 * 1024 * 1024
    finally:
        for sock in connections:
            sock.close()


def test_a_client_that_reads_nothing_of_its_stream_is_cut_off(gateway: int, backend: str) -> None:
    """A client that never read its stream held the backend's stream, and its concurrency slot,
    for ever (the gateway waits for the client to read: backpressure). Past the stall timeout
    (server.body_timeout, 1 s here) the connection is cut and the backend stopped."""
    body = orjson.dumps(
        {
            "model": "mock-llm",
            "messages": [{"role": "user", "content": "a long story"}],
            "stream": True,
            "max_tokens": 100_000,
            "mock_completion_tokens": 100_000,  # 50 s at the backend's 2,000 tokens/s
        }
    )
    cancelled = httpx.get(backend + "/mock/stats").json()["streams_cancelled"]
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", gateway))
        sock.sendall(HEAD + b"content-length: %d\r\n\r\n%b" % (len(body), body))
        deadline = time.monotonic() + 15
        while httpx.get(backend + "/mock/stats").json()["streams_cancelled"] == cancelled:
            assert time.monotonic() < deadline, "the stream runs on for a client that reads nothing"
            time.sleep(0.1)
