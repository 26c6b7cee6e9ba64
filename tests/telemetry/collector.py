"""A stand-in OpenTelemetry collector: takes OTLP/HTTP exports and decodes them."""

from __future__ import annotations

import gzip
import ssl
import threading
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
    """Records every export; answers 503 to the first `refuse` of them."""

    def __init__(self, refuse: int, tls: ssl.SSLContext | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        if tls is not None:
            self.socket = tls.wrap_socket(self.socket, server_side=True)
        self.refuse = refuse
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
        self.send_response(503 if refused else 200)
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
