"""Where and how spans are posted: the OTLP exporter specification's variables, one kept-alive
connection, TLS, proxies."""

from __future__ import annotations

import base64
import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from proxy.telemetry.otlppost import OtlpPoster, otlp_settings
from tests.certs import self_signed
from tests.telemetry.collector import Collector, collector
from tests.telemetry.test_spanbatch import FRAME, request_spans


def test_settings_follow_the_specification() -> None:
    settings = otlp_settings(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "2500",
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "a=1, b = x%3Dy ,broken",
        }
    )
    assert settings.endpoint == "http://collector:4318/v1/traces"
    assert settings.timeout_s == 2.5
    assert settings.headers == {"a": "1", "b": "x=y"}
    assert settings.gzip is False
    signal = otlp_settings(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://traces.example:443/custom",
            "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "gzip",
        }
    )
    assert signal.endpoint == "https://traces.example:443/custom"
    assert signal.gzip is True
    assert otlp_settings({}).endpoint == "http://localhost:4318/v1/traces"


def _body(number: int) -> bytes:
    return FRAME.body(request_spans(number, count=1))


def _names(server: Collector) -> list[str]:
    return [s.name for _, r in server.spans() for rs in r.resource_spans
            for ss in rs.scope_spans for s in ss.spans]  # fmt: skip


def test_posts_share_one_kept_alive_connection() -> None:
    with collector() as server:
        poster = OtlpPoster(
            {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_port}"}
        )
        assert all(poster.send(_body(n), 1) for n in range(5))
        poster.close()
        assert _names(server) == [f"span {n}.0" for n in range(5)]
        assert server.connections == 1
        [headers, *_] = [h for h, _ in server.spans()]
        assert headers["user-agent"].startswith("tokenweir/")


def test_a_connection_the_collector_closed_is_replaced_before_posting() -> None:
    """A collector that answers once per connection and then hangs up, without saying so: each
    post finds the old connection closed and opens another, with no failed try (a try that failed
    would be retried only after 0.5 s, which a timeout under that forbids)."""
    with _one_answer_a_connection() as (port, served):
        poster = OtlpPoster({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"})
        for n in range(3):
            _until_served(served, n)  # the last answer's connection is closed by now
            time.sleep(0.05)
            assert poster.send(_body(n), 1, timeout_s=0.45)
        poster.close()
        _until_served(served, 3)


def test_a_collectors_retry_after_is_waited_for(caplog: pytest.LogCaptureFixture) -> None:
    """A collector throttling with 429 and `Retry-After: 1` is asked again no sooner than a
    second later (not after the back-off's 0.5 s); one asking for 30 s, past the timeout, is
    not asked again at all (it was asked four times more within 7.5 s)."""
    with collector(refuse=1) as server:
        server.refused_with, server.retry_after = 429, "1"
        poster = OtlpPoster(
            {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_port}"}
        )
        began = time.monotonic()
        assert poster.send(_body(1), 1)
        assert time.monotonic() - began >= 1.0
        assert _names(server) == ["span 1.0"]
        server.refuse, server.retry_after = 10, "30"
        assert not poster.send(_body(2), 1)
        poster.close()
    assert len(server.refused_at) == 2
    assert "dropped 1 spans: HTTP 429 (Retry-After 30 s)" in caplog.text


def _until_served(served: list[int], count: int) -> None:
    deadline = time.monotonic() + 10
    while served[0] < count:
        assert time.monotonic() < deadline, f"{served[0]} of {count} posts answered"
        time.sleep(0.01)


def test_tls_with_the_configured_ca_and_a_client_certificate(tmp_path: Path) -> None:
    (tmp_path / "server").mkdir()
    (tmp_path / "client").mkdir()
    server_cert, server_key = self_signed(tmp_path / "server")
    client_cert, client_key = self_signed(tmp_path / "client")
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(server_cert, server_key)
    tls.verify_mode = ssl.CERT_REQUIRED
    tls.load_verify_locations(client_cert)
    with collector(tls=tls) as server:
        endpoint = f"https://127.0.0.1:{server.server_port}"
        trusted = OtlpPoster({
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_EXPORTER_OTLP_CERTIFICATE": str(server_cert),
            "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": str(client_cert),
            "OTEL_EXPORTER_OTLP_CLIENT_KEY": str(client_key),
        })  # fmt: skip
        assert trusted.send(_body(1), 1)
        trusted.close()
        strangers = OtlpPoster({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint})  # certifi's CAs
        assert not strangers.send(_body(2), 1, timeout_s=0.2)
        strangers.close()
        assert _names(server) == ["span 1.0"]


def test_an_http_proxy_from_the_environment_forwards_with_its_login() -> None:
    with collector() as server, _proxy() as (proxy_port, heads):
        endpoint = f"http://127.0.0.1:{server.server_port}/v1/traces"
        environ = {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint,
            "http_proxy": f"http://ops:s%3Acret@127.0.0.1:{proxy_port}",
        }
        poster = OtlpPoster(environ)
        assert poster.send(_body(1), 1)
        poster.close()
        exempt = OtlpPoster({**environ, "NO_PROXY": "localhost,127.0.0.1"})
        assert exempt.send(_body(2), 1)
        exempt.close()
        assert _names(server) == ["span 1.0", "span 2.0"]
    [head] = heads  # the exempt post went straight to the collector
    assert head.startswith(f"POST {endpoint} HTTP/1.1\r\n".encode())
    assert b"\r\nproxy-authorization: Basic " + base64.b64encode(b"ops:s:cret") in head


@pytest.mark.parametrize(
    ("endpoint", "no_proxy", "through_proxy"),
    [
        ("http://127.0.0.1:{port}/v1/traces", "example.com, 127.0.0.1:{port}", False),
        ("http://127.0.0.1:{port}/v1/traces", "127.0.0.1:{other}", True),  # another port
        ("http://127.0.0.1:{port}/v1/traces", "127.0.0.0/8", False),
        ("http://127.0.0.1:{port}/v1/traces", "10.0.0.0/8,localhost,0.0.1", True),
        # nothing listens on [::1]:9: only whether the post goes to the proxy is looked at
        ("http://[::1]:9/v1/traces", "[::1]:9", False),
        ("http://[::1]:9/v1/traces", "::1", False),
        ("http://[::1]:9/v1/traces", "[::1]:10,::2", True),
    ],
)
def test_no_proxy_takes_ports_networks_and_ipv6_addresses(
    endpoint: str, no_proxy: str, through_proxy: bool
) -> None:
    with collector() as server, _proxy() as (proxy_port, heads):
        port = server.server_port
        poster = OtlpPoster({
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint.format(port=port),
            "HTTP_PROXY": f"http://127.0.0.1:{proxy_port}",
            "NO_PROXY": no_proxy.format(port=port, other=port + 1),
        })  # fmt: skip
        poster.send(_body(1), 1, timeout_s=0.3)
        poster.close()
        if through_proxy:  # the proxy records a head before it forwards it, maybe late
            deadline = time.monotonic() + 10
            while not heads and time.monotonic() < deadline:
                time.sleep(0.01)
            assert heads
        else:
            assert not heads


def test_an_https_collector_is_reached_through_a_connect_tunnel(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    with collector(tls=tls) as server, _proxy() as (proxy_port, heads):
        poster = OtlpPoster({
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"https://127.0.0.1:{server.server_port}",
            "OTEL_EXPORTER_OTLP_CERTIFICATE": str(cert),
            "HTTPS_PROXY": f"127.0.0.1:{proxy_port}",
        })  # fmt: skip
        assert poster.send(_body(1), 1)
        poster.close()
        assert _names(server) == ["span 1.0"]
    [head] = heads
    assert head.startswith(f"CONNECT 127.0.0.1:{server.server_port} HTTP/1.".encode())


def test_an_endpoint_that_is_no_url_drops_batches_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    poster = OtlpPoster({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"})  # no scheme
    assert not poster.send(_body(1), 3)
    poster.close()
    assert "dropped 3 spans: the endpoint is not an http:// or https:// URL" in caplog.text


def test_close_ends_a_post_the_collector_never_answers() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # takes the post, never answers
        silent.settimeout(30)
        port = silent.getsockname()[1]
        poster = OtlpPoster({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"})
        result: list[bool] = []
        post = threading.Thread(target=lambda: result.append(poster.send(_body(1), 1, 60.0)))
        began = time.monotonic()
        post.start()
        conn, _ = silent.accept()
        with conn:
            assert conn.recv(65536).startswith(b"POST /v1/traces ")  # it now waits
            poster.close()
            post.join(30)
    assert result == [False]
    assert time.monotonic() - began < 30  # not the minute the post may take


@pytest.mark.parametrize(("chunk_bytes", "pause_s"), [(65536, 0.0), (1, 0.1)])
def test_an_answer_without_end_is_read_no_further_than_its_limit_or_the_timeout(
    chunk_bytes: int, pause_s: float
) -> None:
    """A collector that takes the batch (200) and then streams its answer's body without end,
    fast or a byte at a time: the post is done within its timeout, the batch taken, having read
    a bounded part (the exporter read it all, 200 MB into memory, or for as long as it went on)."""
    sent = [0]

    def endless(conn: socket.socket) -> None:
        _read_message(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n" % chunk_bytes + b"x" * chunk_bytes + b"\r\n"
        stop = time.monotonic() + 20
        while sent[0] < 200_000_000 and time.monotonic() < stop:
            conn.sendall(chunk)
            sent[0] += chunk_bytes
            time.sleep(pause_s)

    with _serving(endless) as port:
        poster = OtlpPoster(
            {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
             "OTEL_EXPORTER_OTLP_TIMEOUT": "2000"}
        )  # fmt: skip
        began = time.monotonic()
        assert poster.send(_body(1), 1)
        assert time.monotonic() - began < 10
        poster.close()
    assert sent[0] < 32_000_000


@contextmanager
def _serving(handle: Callable[[socket.socket], None]) -> Iterator[int]:
    """A raw server on 127.0.0.1 that runs `handle` on each connection in a thread of its
    own (and closes it after); yields its port."""
    listener = socket.create_server(("127.0.0.1", 0))

    def one(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            handle(conn)

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                threading.Thread(target=one, args=(listener.accept()[0],), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()


@contextmanager
def _one_answer_a_connection() -> Iterator[tuple[int, list[int]]]:
    """A raw collector: reads one request a connection, answers 200 (keep-alive, as far as the
    client can tell), closes the connection; yields its port and the count answered."""
    served = [0]

    def answer_once(conn: socket.socket) -> None:
        _read_message(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        conn.shutdown(socket.SHUT_WR)
        served[0] += 1

    with _serving(answer_once) as port:
        yield port, served


@contextmanager
def _proxy() -> Iterator[tuple[int, list[bytes]]]:
    """A raw forward proxy: a request in absolute form goes to its host (one a connection),
    a CONNECT becomes a tunnel; yields its port and the request heads it saw."""
    heads: list[bytes] = []

    def forward(conn: socket.socket) -> None:
        head, body = _read_message(conn)
        heads.append(head)
        method, target, _ = head.split(b"\r\n")[0].split(b" ")
        if method == b"CONNECT":
            host, port = target.decode().rsplit(":", 1)
            with socket.create_connection((host, int(port))) as upstream:
                conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                back = threading.Thread(target=_pipe, args=(upstream, conn), daemon=True)
                back.start()
                _pipe(conn, upstream)
                back.join(10)
            return
        url = urlsplit(target.decode())
        with socket.create_connection((url.hostname, url.port)) as upstream:
            lines = head.split(b"\r\n")
            lines[0] = b" ".join([method, url.path.encode(), b"HTTP/1.1"])
            upstream.sendall(b"\r\n".join(lines) + body)
            answer, answer_body = _read_message(upstream)
            conn.sendall(answer[:-2] + b"connection: close\r\n\r\n" + answer_body)

    with _serving(forward) as port:
        yield port, heads


def _read_message(conn: socket.socket) -> tuple[bytes, bytes]:
    """One HTTP message from `conn`: its head (through the blank line) and its body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("closed in the middle of a message")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    length = next((int(x.split(b":")[1]) for x in lines if x.startswith(b"content-length:")), 0)
    while len(body) < length:
        body += conn.recv(65536)
    return head + b"\r\n\r\n", body


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while chunk := source.recv(65536):
            sink.sendall(chunk)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)
