"""W3C trace context for both span paths: the client's `traceparent` and `tracestate` read
exactly as the OpenTelemetry API's TraceContextTextMapPropagator reads them, but without its
Context objects and without its warnings (it logs a client's malformed header, text and all,
once per request), and `traceparent` written for the backend as it writes it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "RANDOM_TRACE_ID",
    "SAMPLED",
    "RemoteParent",
    "passed_on",
    "remote_parent",
    "trace_headers",
]

SAMPLED = 0x01
RANDOM_TRACE_ID = 0x02  # trace context level 2: the trace id's low 56 bits are random

# The propagator's own pattern and limits (opentelemetry.trace.propagation.tracecontext).
_TRACEPARENT = re.compile(
    "^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:(-.*)|[ \t]*)$"
)
_MAX_TRACEPARENT_CHARS = 512
# The API's tracestate rules (opentelemetry.trace.span): its member pattern, at most 32 members
# and 8192 characters; an invalid member or a repeated key discards the whole header.
_MAX_TRACESTATE_CHARS = 8192
_MAX_TRACESTATE_MEMBERS = 32
_MEMBER = re.compile(
    r"([a-z][_0-9a-z\-\*\/]{0,255}|[a-z0-9][_0-9a-z\-\*\/]{0,240}@[a-z][_0-9a-z\-\*\/]{0,13})"
    r"=([\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e])"
)
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16
_FLAGS = tuple(f"-{flags:02x}" for flags in range(256))  # traceparent's last field


@dataclass(frozen=True, slots=True)
class RemoteParent:
    """The client's span, which the request's SERVER span continues."""

    trace_id: int
    span_id: int
    flags: int
    state: str  # the tracestate as the API renders it again; "" for none


def remote_parent(headers: Mapping[str, str]) -> RemoteParent | None:
    """The client's span from its headers; None where the propagator would find none."""
    header = headers.get("traceparent")
    if not header or len(header) > _MAX_TRACEPARENT_CHARS:
        return None
    match = _TRACEPARENT.search(header)
    if not match:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    if (version == "00" and rest) or version == "ff":
        return None
    return RemoteParent(int(trace_id, 16), int(span_id, 16), int(flags, 16), _state(headers))


def _state(headers: Mapping[str, str]) -> str:
    """The tracestate as TraceState.from_header(...).to_header() renders it, "" for none or
    an invalid one; rare (only with a traceparent), and silent whatever a client sends."""
    state = headers.get("tracestate")
    if state is None or len(state) > _MAX_TRACESTATE_CHARS:
        return ""
    members: dict[str, str] = {}
    for member in state.split(","):
        member = member.strip(" \t")
        if not member:
            continue
        match = _MEMBER.fullmatch(member)
        if match is None or match.group(1) in members:
            return ""
        members[match.group(1)] = match.group(2)
    if len(members) > _MAX_TRACESTATE_MEMBERS:
        return ""
    return ",".join(key + "=" + value for key, value in members.items())


def trace_headers(trace_id: int, span_id: int, flags: int, state: str) -> dict[str, str]:
    """`traceparent` (and `tracestate`, if any) carrying span `span_id` to the backend."""
    # The ids' hex from their bytes: half the cost of an f-string's `:032x`.
    traceparent = (
        "00-" + trace_id.to_bytes(16, "big").hex() + "-" + span_id.to_bytes(8, "big").hex()
    )
    headers = {"traceparent": traceparent + _FLAGS[flags]}
    if state:
        headers["tracestate"] = state
    return headers


def passed_on(headers: Mapping[str, str]) -> dict[str, str]:
    """The client's trace context for the backend when the gateway does not trace: its own
    span stays the parent; nothing where the propagator would find no valid one."""
    parent = remote_parent(headers)
    if parent is None:
        return {}
    return trace_headers(parent.trace_id, parent.span_id, parent.flags, parent.state)
