"""A stand-in OpenTelemetry collector: takes OTLP/HTTP exports and decodes them."""

from __future__ import annotations

import gzip
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from proxy.policy.units import hash_key
from tests.conftest import BACKEND_KEY, BETA_KEY, policy_text


class Collector(ThreadingHTTPServer):
    """Records every export; answers `refused_with` (503) to the first `refuse` of them, with
    a `Retry-After` of `retry_after` if set, noting when (`refused_at`)."""

    def __init__(self, refuse: int, tls: ssl.SSLContext | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        if tls is not None:
            self.socket = tls.wrap_socket(self.socket, server_side=True)
        self.refuse = refuse
        self.refused_with = 503
        self.retry_after: str | None = None
        self.refused_at: list[float] = []
        self.refused_spans = 0  # in the posts refused
        self.posts: list[tuple[str, dict[str, str], bytes]] = []
        self.connections = 0
        self.lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.lock:
            self.connections += 1
        super().process_request(request, client_address)

    def _bodies(self, path: str) -> list[tuple[dict[str, str], bytes]]:
        with self.lock:
            posts = [(headers, body) for p, headers, body in self.posts if p == path]
        return [
            (headers, gzip.decompress(body) if headers.get("content-encoding") == "gzip" else body)
            for headers, body in posts
        ]

    def spans(self) -> list[tuple[dict[str, str], ExportTraceServiceRequest]]:
        return [
            (headers, ExportTraceServiceRequest.FromString(body))
            for headers, body in self._bodies("/v1/traces")
        ]

    def metrics(self) -> list[ExportMetricsServiceRequest]:
        return [ExportMetricsServiceRequest.FromString(b) for _, b in self._bodies("/v1/metrics")]


def _span_count(body: bytes) -> int:
    request = ExportTraceServiceRequest.FromString(body)
    return sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)


class _Handler(BaseHTTPRequestHandler):
    server: Collector
    protocol_version = "HTTP/1.1"  # keep-alive, as a collector

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        with self.server.lock:
            refused = self.server.refuse > 0
            self.server.refuse -= 1
            if not refused:
                headers = {k.lower(): v for k, v in self.headers.items()}
                self.server.posts.append((self.path, headers, body))
            else:
                self.server.refused_at.append(time.monotonic())
                if self.path == "/v1/traces":
                    self.server.refused_spans += _span_count(body)
        self.send_response(self.server.refused_with if refused else 200)
        if refused and self.server.retry_after is not None:
            self.send_header("retry-after", self.server.retry_after)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def collector(refuse: int = 0, tls: ssl.SSLContext | None = None) -> Iterator[Collector]:
    """A collector on 127.0.0.1 (over TLS with `tls`, a server context)."""
    server = Collector(refuse, tls)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def policy_file(backend_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The tests' usual policy as a file a `tokenweir serve` process can read."""
    config = tmp_path / "policy.yaml"
    config.write_text(policy_text(backend_url))
    monkeypatch.setenv("BACKEND_KEY", BACKEND_KEY)
    monkeypatch.setenv("BETA_KEY", hash_key(BETA_KEY))
    return config
