"""A gateway whose spans land in memory, in front of a backend that records request headers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.app import create_app
from proxy.policy.units import hash_key
from proxy.telemetry.sdk import OtelSdk
from proxy.tools.mock import backend as mockbackend
from tests.conftest import make_policy
from tests.servers import serve

GAMMA_KEY = "tw-test-gamma"
CACHED_KEY = "tw-test-cached"
LIMITED_KEY = "tw-test-limited"


def extra_tenant(name: str, key: str, *, budget: str, limits: str) -> str:
    """Policy lines for one more tenant on mock-llm (for `make_policy(..., extra=...)`)."""
    return f"""
  {name}:
    api_keys: [{hash_key(key)}]
    models: [mock-llm]
    budget: {budget}
    limits: {limits}
"""


# A tenant whose quota and rate limit put storage I/O on the request path.
GAMMA = extra_tenant(
    "gamma", GAMMA_KEY, budget="{tokens_per_day: 1000000}", limits="{requests_per_minute: 1000}"
)
# A tenant whose second request in a minute the rate limit refuses.
LIMITED = extra_tenant(
    "limited", LIMITED_KEY, budget="{tokens_per_day: 1000000}", limits="{requests_per_minute: 1}"
)


@dataclass
class HeaderRecorder:
    """ASGI middleware: keeps the headers of every request the backend receives."""

    app: ASGIApp
    seen: list[dict[str, str]] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.seen.append({k.decode(): v.decode() for k, v in scope["headers"]})
        await self.app(scope, receive, send)


@dataclass
class Traced:
    url: str
    exporter: InMemorySpanExporter
    backend: HeaderRecorder

    def spans(self, count: int, timeout_s: float = 3.0) -> list[ReadableSpan]:
        """The finished spans, once at least `count` have ended (Account ends the last one
        just after the client has its answer)."""
        deadline = time.monotonic() + timeout_s
        while len(self.exporter.get_finished_spans()) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return list(self.exporter.get_finished_spans())


@pytest.fixture(scope="module")
def traced_gateway() -> Iterator[Traced]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    backend = HeaderRecorder(mockbackend.create_app(ttft_ms=0, tokens_per_second=2000))
    with serve(backend) as backend_url:
        cached = f"""
  cached:
    api_keys: [{hash_key(CACHED_KEY)}]
    models: [mock-llm]
    cache: {{mode: exact}}
"""
        policy = make_policy(backend_url, extra=GAMMA + LIMITED + cached)
        with serve(create_app(policy, otel=OtelSdk(provider, None))) as url:
            yield Traced(url, exporter, backend)
    provider.shutdown()


@pytest.fixture
def traced(traced_gateway: Traced) -> Traced:
    traced_gateway.exporter.clear()
    traced_gateway.backend.seen.clear()
    return traced_gateway
