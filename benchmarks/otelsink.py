"""For the telemetry benchmark: a stand-in OpenTelemetry collector and a Prometheus scraper.

The sink accepts OTLP/HTTP exports (POST /v1/traces, /v1/metrics) and drops them, so the
gateway pays the whole SDK path (spans, batching, protobuf encoding, HTTP) but no real
collector runs on the machine. The scraper reads `/metrics` every few seconds, as Prometheus
would.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx


class _Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a collector: no new connection per export

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        self.server.received += 1  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def otlp_sink() -> Iterator[tuple[str, ThreadingHTTPServer]]:
    """An OTLP/HTTP endpoint on 127.0.0.1; yields its URL and the server (`.received`)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    server.received = 0  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def scraping(url: str, enabled: bool, every_s: float = 5.0) -> Iterator[None]:
    """GET `url`/metrics every `every_s` while the block runs (when enabled)."""
    stop = threading.Event()

    def scrape() -> None:
        while not stop.wait(every_s):
            httpx.get(url + "/metrics", timeout=10)

    thread = threading.Thread(target=scrape, daemon=True)
    if enabled:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if enabled:
            thread.join(timeout=15)


def main() -> None:
    """`python benchmarks/otelsink.py PORT`: the sink alone, in a process of its own, until killed
    (so a benchmark that reads its own CPU time does not count the sink's)."""
    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), _Sink)
    server.received = 0  # type: ignore[attr-defined]
    server.serve_forever()


if __name__ == "__main__":
    main()
