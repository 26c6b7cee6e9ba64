"""One request's tracing hooks driven through both span paths with the same ids and times.

The API path runs on an SDK TracerProvider (spans kept in memory, encoded by otlpwire); the
direct path writes its own protobuf. Both draw ids from a Random seeded alike, so the same
request must come out as the same bytes.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from unittest import mock

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider, sampling
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator

from proxy import __version__
from proxy.context import Admitted, RequestContext, TraceHooks
from proxy.outgoing import OutgoingRequest
from proxy.policy import Policy
from proxy.telemetry.directtrace import DirectTracing
from proxy.telemetry.otlpwire import encode_spans
from proxy.telemetry.samplers import head_sampler
from proxy.telemetry.spanwire import SpanFrame
from proxy.telemetry.traces import TraceSource, span_attributes
from proxy.telemetry.tracing import Tracing
from proxy.upstream.meter import StreamMeter

RESOURCE = Resource.create({"service.name": "tokenweir", "service.instance.id": "a1"})
RECEIVED_S = 1000.0
_SAMPLER_VARIABLES = ("OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG")
RECEIVED_WALL = 1_764_000_000.25


class SeededIds(IdGenerator):
    """The SDK's RandomIdGenerator, on a Random of its own."""

    def __init__(self, seed: int) -> None:
        self.bits = random.Random(seed).getrandbits  # noqa: S311 (ids, as the SDK makes them)

    def generate_span_id(self) -> int:
        span_id = self.bits(64)
        while not span_id:
            span_id = self.bits(64)
        return span_id

    def generate_trace_id(self) -> int:
        trace_id = self.bits(128)
        while not trace_id:
            trace_id = self.bits(128)
        return trace_id

    def is_trace_id_random(self) -> bool:
        return True


@dataclass
class Outcome:
    spans: bytes  # the OTLP request body of the request's spans (b"" for none)
    headers: dict[str, str]  # what upstream_started gave the backend call


Drive = Callable[[TraceHooks, Admitted], dict[str, str]]


def context(policy: Policy, tenant: str, headers: Mapping[str, str]) -> Admitted:
    arrival = RequestContext(
        request_id="req_0123456789abcdef",
        operation="chat",
        received_s=RECEIVED_S,
        received_wall=RECEIVED_WALL,
        meter=StreamMeter(RECEIVED_S),
        headers=headers,
    )
    ctx = arrival.admit(tenant, policy.tenants[tenant], None)
    ctx.outgoing = OutgoingRequest({"model": "mock-llm", "max_tokens": 20}, "mock-llm")
    ctx.backend = policy.backends[0]
    return ctx


def finish(trace: TraceHooks, ctx: RequestContext, now_s: float) -> None:
    """As the recorder ends a request: attributes only when the trace records."""
    attributes = span_attributes(ctx, 812.5, 0.000123) if trace.recording else None
    trace.finish(ctx, now_s, attributes)


def via_api(
    environ: Mapping[str, str], seed: int, new_ctx: Callable[[], Admitted], drive: Drive
) -> Outcome:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(
        sampler=sdk_sampler(environ), resource=RESOURCE, id_generator=SeededIds(seed)
    )
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    outcome = _run(Tracing(provider), new_ctx(), drive)
    outcome.spans = encode_spans(exporter.get_finished_spans())
    provider.shutdown()
    return outcome


def via_direct(
    environ: Mapping[str, str],
    seed: int,
    new_ctx: Callable[[], Admitted],
    drive: Drive,
    tracing: DirectTracing | None = None,
) -> Outcome:
    """`tracing`, if given, is one that has seen other requests: its ids are reseeded and its
    queue replaced, and what it keeps from them stays."""
    queued: list[bytes] = []
    bits = random.Random(seed).getrandbits  # noqa: S311 (ids, as the SDK makes them)
    if tracing is None:
        tracing = DirectTracing(queued.extend, head_sampler(environ), bits)
    else:
        tracing.queue, tracing.bits = queued.extend, bits
    outcome = _run(tracing, new_ctx(), drive)
    frame = SpanFrame(RESOURCE.attributes, ("tokenweir", __version__), RESOURCE.schema_url)
    outcome.spans = frame.body(queued) if queued else b""
    return outcome


def _run(source: TraceSource, ctx: Admitted, drive: Drive) -> Outcome:
    return Outcome(b"", drive(source.begin(ctx), ctx))


def sdk_sampler(environ: Mapping[str, str]) -> sampling.Sampler:
    """What the SDK makes of OTEL_TRACES_SAMPLER(_ARG), which it reads with os.getenv. Only
    os.getenv is replaced, never os.environ itself: setenv while another thread (a server's)
    reads the C environment can crash the process (it did, once, in a suite run)."""
    real = os.getenv

    def getenv(name: str, default: str | None = None) -> str | None:
        if name in _SAMPLER_VARIABLES:
            return environ.get(name, default)
        return real(name, default)

    with mock.patch.object(os, "getenv", getenv):
        return sampling._get_from_env_or_default()
