"""The direct span path writes, for the same request, ids and times, the bytes the API path's
SDK spans encode to: names, kinds, parentage, attributes, status, tracestate, all of it."""

from __future__ import annotations

from functools import partial

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from proxy.context import RequestContext, TraceHooks
from proxy.outgoing import OutgoingRequest
from proxy.telemetry.attrwire import AttributeWriter
from proxy.telemetry.directtrace import DirectTracing
from proxy.telemetry.samplers import head_sampler
from proxy.telemetry.spanwire import (
    INTERNAL,
    LOCAL_PARENT,
    PARENT_ID,
    SERVER,
    SPAN_ID,
    UNSET,
    SpanFrame,
    child_layout,
    framed_span,
    span_head,
    span_ids,
)
from tests.conftest import make_policy
from tests.telemetry.conftest import GAMMA
from tests.telemetry.twopaths import RECEIVED_S, Drive, context, finish, via_api, via_direct

POLICY = make_policy("http://127.0.0.1:9", extra=GAMMA)
PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def answered(trace: TraceHooks, ctx: RequestContext) -> dict[str, str]:
    trace.stage_ran("Auth", RECEIVED_S, RECEIVED_S + 0.0001)
    trace.stage_ran("Budgets", RECEIVED_S + 0.0001, RECEIVED_S + 0.0003)
    trace.stage_ran("RateLimits", RECEIVED_S + 0.0003, RECEIVED_S + 0.0004)
    headers = trace.upstream_started(ctx, RECEIVED_S + 0.0005)
    ctx.outcome.status, ctx.input_tokens, ctx.output_tokens = 200, 12, 20
    ctx.outcome.tail = b'"model":"mock-llm","finish_reason":"length"}]}'
    trace.upstream_ended(RECEIVED_S + 0.0125, 200, None)
    trace.stage_ran("settle", RECEIVED_S + 0.013, RECEIVED_S + 0.0131)
    finish(trace, ctx, RECEIVED_S + 0.0132)
    return headers


def failing(error: str) -> Drive:
    """The backend call fails with `error`, and so does the request (502)."""

    def backend_failed(trace: TraceHooks, ctx: RequestContext) -> dict[str, str]:
        headers = trace.upstream_started(ctx, RECEIVED_S + 0.0005)
        trace.upstream_ended(RECEIVED_S + 0.002, None, error)
        ctx.outcome.status, ctx.outcome.error_code = 502, error
        finish(trace, ctx, RECEIVED_S + 0.0021)
        return headers

    return backend_failed


backend_failed = failing("upstream_error")
timed_out = failing("upstream_timeout")  # the same status, another description
long_code = failing("e" * 300)  # a backend's error code, cut on both spans


def relay_cut(trace: TraceHooks, ctx: RequestContext) -> dict[str, str]:
    """The client went away mid-stream: the backend call's span ends with the request."""
    headers = trace.upstream_started(ctx, RECEIVED_S + 0.0005)
    ctx.outcome.status, ctx.stream, ctx.outcome.client_disconnected = 200, True, True
    finish(trace, ctx, RECEIVED_S + 0.5)
    return headers


def rejected(trace: TraceHooks, ctx: RequestContext) -> dict[str, str]:
    ctx.outgoing, ctx.tenant_name, ctx.tenant, ctx.backend = OutgoingRequest({}), None, None, None
    ctx.outcome.status, ctx.outcome.error_code = 401, "invalid_api_key"
    finish(trace, ctx, RECEIVED_S + 0.0002)
    return {}


def long_values(trace: TraceHooks, ctx: RequestContext) -> dict[str, str]:
    """Strings past 127 bytes (two-byte lengths), non-ASCII, a model name clipped."""
    ctx.request_id = "req_" + "é" * 90
    ctx.outgoing.set_model("m" * 100)
    ctx.degraded = ["shorten-under-load", "spill-to-small-model"] * 4
    return answered(trace, ctx)


def degraded(trace: TraceHooks, ctx: RequestContext) -> dict[str, str]:
    """As `answered`, but degraded: only a late repeating attribute differs."""
    ctx.degraded = ["shorten-under-load"]
    return answered(trace, ctx)


DRIVES = [
    answered,
    degraded,
    backend_failed,
    timed_out,
    long_code,
    relay_cut,
    rejected,
    long_values,
]
HEADERS = [
    {}, {"traceparent": PARENT}, {"traceparent": PARENT, "tracestate": "rojo=00f067aa,congo=t61"},
]  # fmt: skip


@pytest.mark.parametrize("drive", DRIVES)
@pytest.mark.parametrize("headers", HEADERS, ids=["root", "remote-parent", "tracestate"])
@pytest.mark.parametrize("tenant", ["alpha", "gamma"])
def test_the_same_request_makes_the_same_bytes(
    drive: Drive, headers: dict[str, str], tenant: str
) -> None:
    for seed in range(3):
        api = via_api({}, seed, partial(context, POLICY, tenant, headers), drive)
        direct = via_direct({}, seed, partial(context, POLICY, tenant, headers), drive)
        assert api.spans
        assert direct.spans == api.spans
        assert direct.headers == api.headers


def test_what_one_request_leaves_behind_changes_no_other_requests_bytes() -> None:
    """One tracer keeps the encodings of what repeats (a backend call, the request span's name,
    status and repeating attributes); requests that differ in any of it, in turn and again,
    each come out as a fresh tracer writes them."""
    tracing = DirectTracing(lambda spans: None, head_sampler({}))
    for round_ in range(2):
        for drive in DRIVES:
            for headers in HEADERS:
                for tenant in ("alpha", "gamma"):
                    new_ctx = partial(context, POLICY, tenant, headers)
                    fresh = via_direct({}, round_, new_ctx, drive)
                    kept = via_direct({}, round_, new_ctx, drive, tracing)
                    assert kept.spans == fresh.spans, (round_, drive.__name__, headers, tenant)
                    assert kept.spans


def test_a_sampled_out_request_records_nothing_and_passes_the_decision_on() -> None:
    environ = {"OTEL_TRACES_SAMPLER": "parentbased_always_off"}
    for headers in ({}, {"traceparent": PARENT[:-2] + "00", "tracestate": "k=v"}):
        api = via_api(environ, 7, partial(context, POLICY, "gamma", headers), answered)
        direct = via_direct(environ, 7, partial(context, POLICY, "gamma", headers), answered)
        assert api.spans == direct.spans == b""
        assert direct.headers == api.headers
        assert int(direct.headers["traceparent"][-2:], 16) & 1 == 0


@pytest.mark.parametrize("state", ["", "rojo=00f067aa"])
@pytest.mark.parametrize("parent_id", [0, 0x0102030405060708])
@pytest.mark.parametrize("value_chars", [0, 40, 16_300, 70_000])
def test_a_span_of_any_size_is_framed_as_protobuf_reads_it(
    state: str, parent_id: int, value_chars: int
) -> None:
    """Span sizes under 128 bytes, under 16 KiB and over it take one, two and three bytes of
    frame; with a tracestate the ids are written around it."""
    values = AttributeWriter().pairs([("k", "v" * value_chars)] if value_chars else [])
    trace_id, span_id = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
    span = framed_span(span_ids(trace_id, state), span_id, parent_id, span_head("n", SERVER), 5,
                       9, values, UNSET, LOCAL_PARENT)  # fmt: skip
    body = SpanFrame({"service.name": "t"}, ("tokenweir", "1")).body([span, span])
    request = ExportTraceServiceRequest.FromString(body)
    read = request.resource_spans[0].scope_spans[0].spans
    assert len(read) == 2
    assert read[0] == read[1]
    assert read[0].trace_id == trace_id.to_bytes(16, "big")
    assert read[0].span_id == span_id.to_bytes(8, "big")
    assert read[0].parent_span_id == (parent_id.to_bytes(8, "big") if parent_id else b"")
    assert read[0].trace_state == state
    assert (read[0].name, read[0].start_time_unix_nano, read[0].end_time_unix_nano) == ("n", 5, 9)
    assert [a.value.string_value for a in read[0].attributes] == (
        ["v" * value_chars] if value_chars else []
    )


@pytest.mark.parametrize("state", ["", "rojo=00f067aa"])
@pytest.mark.parametrize("tail_chars", [0, 40, 16_300])
def test_a_child_span_from_its_layout_is_framed_span_s_bytes(state: str, tail_chars: int) -> None:
    """A backend call's or a storage stage's span, written from its layout (one struct call),
    is the span framed_span writes, of one, two or three bytes of frame, with a tracestate
    between its id and its parent's, and protobuf reads it back."""
    trace_id, span_id, parent_id = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, 7
    values = AttributeWriter().pairs([("k", "v" * tail_chars)] if tail_chars else [])
    head, start_ns, end_ns = span_head("tokenweir.cache.lookup", INTERNAL), 5, 2**63
    trace, state_field = span_ids(trace_id, state)
    between = state_field + PARENT_ID + parent_id.to_bytes(8, "big")
    pack, frame, head_field, tail = child_layout(head, values + UNSET + LOCAL_PARENT, len(between))
    span = pack(frame, trace + SPAN_ID, span_id.to_bytes(8, "big"), between, head_field,
                start_ns, 0x41, end_ns, tail)  # fmt: skip
    assert span == framed_span(
        (trace, state_field), span_id, parent_id, head, start_ns, end_ns, values, UNSET,
        LOCAL_PARENT,
    )  # fmt: skip
    body = SpanFrame({"service.name": "t"}, ("tokenweir", "1")).body([span])
    [read] = ExportTraceServiceRequest.FromString(body).resource_spans[0].scope_spans[0].spans
    assert (read.span_id, read.parent_span_id) == (
        span_id.to_bytes(8, "big"),
        bytes(7 * [0]) + b"\x07",
    )
    assert (read.trace_state, read.start_time_unix_nano, read.end_time_unix_nano) == (
        state, start_ns, end_ns,
    )  # fmt: skip
    assert len(read.attributes) == (1 if tail_chars else 0)
