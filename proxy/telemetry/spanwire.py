"""The gateway's own spans in OTLP protobuf, written from plain values (no SDK span objects).

The bytes are those otlpwire writes for the SDK's spans with the same ids, names, kinds, times,
attributes and status (tests/telemetry/test_directtrace.py compares them): each span is one
`ScopeSpans.spans` field, and a batch wraps them once in the resource and the scope.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from proxy.telemetry import protowire
from proxy.telemetry.protowire import SIZES, field, fixed32, text, varint

__all__ = [
    "CLIENT",
    "END_TIME",
    "INTERNAL",
    "LOCAL_PARENT",
    "PARENT_ID",
    "REMOTE_PARENT",
    "SERVER",
    "SPAN_ID",
    "START_TIME",
    "UNSET",
    "ChildLayout",
    "SpanFrame",
    "child_layout",
    "error_status",
    "framed_span",
    "span_head",
    "span_ids",
]

INTERNAL, SERVER, CLIENT = 1, 2, 3  # OTLP's Span.SpanKind
LOCAL_PARENT = b"\x85\x01" + fixed32(0x100)  # SpanFlags: has-is-remote, not remote
REMOTE_PARENT = b"\x85\x01" + fixed32(0x300)  # ... and remote
_ID = struct.Struct(">HQ")  # Span.span_id (or parent_span_id) after its tag and size
SPAN_ID, PARENT_ID = b"\x12\x08", b"\x22\x08"
"""Span.span_id's and Span.parent_span_id's tag and size, before the id's eight bytes."""
# Span.trace_id, span_id (and parent_span_id) when no tracestate comes between them.
_TRACE_ID = struct.Struct(">18sHQ")
_TRACE_IDS = struct.Struct(">18sHQHQ")
START_TIME, END_TIME = 0x39, 0x41
"""Span.start_time_unix_nano's and Span.end_time_unix_nano's tags (fixed64 fields)."""
_TIMES = struct.Struct("<BQBQ")  # start and end time, each after its tag
_KINDS = {kind: bytes((0x30, kind)) for kind in (INTERNAL, SERVER, CLIENT)}
UNSET = b"\x7a\x00"
"""An empty Status field: the status is unset."""


def error_status(description: str | None) -> bytes:
    """A Status field with code ERROR and the description, if any."""
    return field(0x7A, (text(0x12, description) if description else b"") + b"\x18\x02")


def span_ids(trace_id: int, state: str) -> tuple[bytes, bytes]:
    """The fields every span of a trace has: its trace id, and its tracestate (b"" for none)."""
    return b"\x0a\x10" + trace_id.to_bytes(16, "big"), text(0x1A, state) if state else b""


def span_head(name: str, kind: int) -> bytes:
    """A span's name and kind fields, which framed_span takes encoded (spans alike share them)."""
    encoded = name.encode()
    size = len(encoded)
    return b"".join((b"\x2a", SIZES[size] if size < 0x80 else varint(size), encoded, _KINDS[kind]))


def framed_span(
    trace: tuple[bytes, bytes],
    span_id: int,
    parent_id: int,
    head: bytes,
    start_ns: int,
    end_ns: int,
    attributes: bytes,
    status: bytes,
    flags: bytes,
) -> bytes:
    """One `ScopeSpans.spans` field from its parts: `trace` is span_ids(); `parent_id` 0 for
    none; `head` span_head(); `attributes` the encoded `Span.attributes` fields (attrwire);
    `status` UNSET or error_status(); `flags` LOCAL_PARENT or REMOTE_PARENT."""
    trace_id, state = trace
    if state:  # the tracestate goes between the span's id and its parent's
        ids = trace_id + _ID.pack(0x1208, span_id) + state
        if parent_id:
            head = _ID.pack(0x2208, parent_id) + head
    elif parent_id:
        ids = _TRACE_IDS.pack(trace_id, 0x1208, span_id, 0x2208, parent_id)
    else:
        ids = _TRACE_ID.pack(trace_id, 0x1208, span_id)
    size = len(ids) + len(head) + 18 + len(attributes) + len(status) + len(flags)  # 18: times
    return b"".join((
        bytes((0x12, size)) if size < 0x80 else b"\x12" + varint(size), ids, head,
        _TIMES.pack(START_TIME, start_ns, END_TIME, end_ns), attributes, status, flags,
    ))  # fmt: skip


ChildLayout = tuple[Callable[..., bytes], bytes, bytes, bytes]
"""How child spans alike are written, from child_layout: (pack, frame, head, tail)."""


def child_layout(head: bytes, tail: bytes, between: int) -> ChildLayout:
    """Spans alike in all but their ids and times: `head` their span_head(), `tail` their
    attributes, status and flags, encoded; `between` the length of what comes between a span's
    id and its head (its tracestate, if any, and its parent's id). A span is then one call:

        pack(frame, trace, span_id, between, head, start_ns, END_TIME, end_ns, tail)

    with `trace` the trace id field and the span id's tag and size (b"\x0a\x10" + 16 bytes +
    b"\x12\x08"), `span_id` its 8 bytes: framed_span's bytes for the same span."""
    size = 28 + between + len(head) + 18 + len(tail)  # 28: the trace id and the span id
    frame = b"\x12" + varint(size)
    pack = struct.Struct(f"<{len(frame)}s20s8s{between}s{len(head) + 1}sQBQ{len(tail)}s").pack
    return pack, frame, head + bytes((START_TIME,)), tail


class SpanFrame:
    """Wraps encoded spans in one ExportTraceServiceRequest: one resource, one scope."""

    __slots__ = ("_resource", "_scope", "_tail")

    def __init__(
        self,
        resource: Mapping[str, Any],
        scope: tuple[str, str],
        resource_schema_url: str = "",
    ) -> None:
        self._resource = field(0x0A, protowire.attributes(0x0A, resource))
        name, version = scope
        self._scope = field(0x0A, (text(0x0A, name) if name else b"") + (
            text(0x12, version) if version else b""
        ))  # fmt: skip
        self._tail = text(0x1A, resource_schema_url) if resource_schema_url else b""

    def body(self, spans: Sequence[bytes]) -> bytes:
        scope_spans = field(0x12, self._scope + b"".join(spans))
        return field(0x0A, self._resource + scope_spans + self._tail)
