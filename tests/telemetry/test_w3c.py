"""The direct path reads a client's trace context exactly as the OpenTelemetry API's propagator."""

from __future__ import annotations

import logging

import pytest
from opentelemetry.trace import get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.datastructures import Headers

from proxy.telemetry.w3c import remote_parent, trace_headers

TRACE, SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
TRACEPARENTS = [
    f"00-{TRACE}-{SPAN}-01",
    f"00-{TRACE}-{SPAN}-00",
    f"00-{TRACE}-{SPAN}-03",
    f"  00-{TRACE}-{SPAN}-01 \t",
    f"00-{TRACE}-{SPAN}-01-extra",  # version 00 allows nothing more
    f"01-{TRACE}-{SPAN}-01-future-fields",  # a later version may add fields
    f"ff-{TRACE}-{SPAN}-01",  # version ff is invalid
    f"00-{TRACE.upper()}-{SPAN}-01",  # hex is lower case
    f"00-{'0' * 32}-{SPAN}-01",
    f"00-{TRACE}-{'0' * 16}-01",
    f"00-{TRACE[:-1]}-{SPAN}-01",
    f"00-{TRACE}-{SPAN}-1",
    f"01-{TRACE}-{SPAN}-01-" + "x" * 520,  # over 512 characters
    "",
    "garbage",
]
TRACESTATES = [
    None,
    "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE",
    " rojo=1 , , congo=2 ",
    "vendor@tenant=x",
    "bad key=1",  # an invalid member discards the whole header
    "a=" + "x" * 600,  # a value over 256 characters
    ",".join(f"k{i}=" + "x" * 200 for i in range(3)),  # over 512 characters, each member valid
    ",".join(f"k{i}=v" for i in range(33)),  # over 32 members
    "rojo=1,rojo=2",  # a key twice
    "k=" + ("x" * 200 + ",k=") * 41,  # over 8192 characters
    "",
]
# What a client may send that the propagator would log a warning for, with the client's text.
MALFORMED = [
    ("00-" + TRACE + "-" + SPAN + "-01" + " " * 600, None),
    (f"00-{TRACE}-{SPAN}-01", "bad member from a client"),
    (f"00-{TRACE}-{SPAN}-01", ",".join(f"k{i}=v" for i in range(33))),
    (f"00-{TRACE}-{SPAN}-01", "k=" + "x" * 9000),
]


@pytest.mark.parametrize("traceparent", TRACEPARENTS)
@pytest.mark.parametrize("tracestate", TRACESTATES)
def test_parsing_matches_the_propagator(traceparent: str, tracestate: str | None) -> None:
    raw = [(b"traceparent", traceparent.encode())]
    if tracestate is not None:
        raw.append((b"tracestate", tracestate.encode()))
    headers = Headers(raw=raw)
    expected = get_current_span(TraceContextTextMapPropagator().extract(headers)).get_span_context()
    ours = remote_parent(headers)
    if not expected.is_valid:
        assert ours is None
        return
    assert ours is not None
    assert (ours.trace_id, ours.span_id, ours.flags) == (
        expected.trace_id,
        expected.span_id,
        expected.trace_flags,
    )
    assert ours.state == expected.trace_state.to_header()


@pytest.mark.parametrize(("traceparent", "tracestate"), MALFORMED)
def test_a_clients_malformed_trace_context_is_read_without_a_log_line(
    traceparent: str, tracestate: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    raw = [(b"traceparent", traceparent.encode())]
    if tracestate is not None:
        raw.append((b"tracestate", tracestate.encode()))
    with caplog.at_level(logging.DEBUG):
        parent = remote_parent(Headers(raw=raw))
    assert caplog.records == []
    assert parent is None or parent.state == ""


def test_written_headers_are_what_the_propagator_reads_back() -> None:
    headers = trace_headers(int(TRACE, 16), int(SPAN, 16), 0x03, "rojo=1,congo=2")
    assert headers == {"traceparent": f"00-{TRACE}-{SPAN}-03", "tracestate": "rojo=1,congo=2"}
    context = get_current_span(TraceContextTextMapPropagator().extract(headers)).get_span_context()
    assert (context.trace_id, context.span_id, context.trace_flags) == (
        int(TRACE, 16),
        int(SPAN, 16),
        3,
    )
    assert trace_headers(1, 2, 0, "") == {"traceparent": f"00-{1:032x}-{2:016x}-00"}
    assert trace_headers(2**128 - 1, 2**64 - 1, 0xFF, "") == {
        "traceparent": f"00-{'f' * 32}-{'f' * 16}-ff"
    }
