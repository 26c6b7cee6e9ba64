"""Protobuf wire format, the few pieces OTLP needs: varints, length-delimited fields, attributes.

Shared by both span encoders (otlpwire for the SDK's spans, spanwire for the gateway's own);
imports nothing from OpenTelemetry. Tags are `(number << 3) | wire type`, always one byte here.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "SIZES",
    "any_value",
    "attributes",
    "double",
    "encoded_key",
    "field",
    "fixed32",
    "fixed64",
    "text",
    "varint",
]

fixed64 = struct.Struct("<Q").pack
fixed32 = struct.Struct("<I").pack
double = struct.Struct("<d").pack
SIZES = [bytes((size,)) for size in range(0x80)]
"""The one-byte varint of each size under 128, prebuilt."""

# Attribute keys repeat across every span: each key's encoded `KeyValue.key` field, once.
_keys: dict[str, bytes] = {}


def varint(value: int) -> bytes:
    if 0 <= value < 0x80:
        return SIZES[value]
    if 0 < value < 0x4000:  # a span's or a batch's size: two bytes
        return bytes(((value & 0x7F) | 0x80, value >> 7))
    value &= 0xFFFFFFFFFFFFFFFF  # a negative int64 is ten bytes of two's complement
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    size = len(payload)
    return bytes((tag, size)) + payload if size < 0x80 else bytes((tag,)) + varint(size) + payload


def text(tag: int, value: str) -> bytes:
    return field(tag, value.encode())


def any_value(value: Any) -> bytes:
    """An AnyValue's body (its oneof field)."""
    if isinstance(value, str):
        return text(0x0A, value)
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + varint(value)
    if isinstance(value, float):
        return b"\x21" + double(value)
    if isinstance(value, bytes):
        return field(0x3A, value)
    if isinstance(value, Sequence):
        return field(0x2A, b"".join([field(0x0A, any_value(item)) for item in value]))
    raise TypeError(f"an attribute value of type {type(value).__name__}")


def attributes(tag: int, values: Mapping[str, Any] | None) -> bytes:
    """Repeated KeyValue under field `tag` (the hot loop: strings inline, sizes under 128 fast).
    None values are left out, as the SDK's attribute cleaning leaves them out."""
    if not values:
        return b""
    head = SIZES[tag]
    parts = []
    # The SDK's attributes are a read-only view of a MutableMapping whose items() is generic
    # Python; copy() is its plain dict's C copy.
    copy = getattr(values, "copy", None)
    plain = copy() if copy is not None else values
    for key, value in plain.items():
        if value is None:
            continue
        if type(value) is str:
            encoded = value.encode()
            size = len(encoded)
            body = (b"\x0a" + SIZES[size] if size < 0x80 else b"\x0a" + varint(size)) + encoded
        else:
            body = any_value(value)
        size = len(body)
        pair = (_keys.get(key) or encoded_key(key)) + (
            b"\x12" + SIZES[size] if size < 0x80 else b"\x12" + varint(size)
        )
        size = len(pair) + len(body)
        parts.append(head + (SIZES[size] if size < 0x80 else varint(size)) + pair + body)
    return b"".join(parts)


def encoded_key(key: str) -> bytes:
    """`KeyValue.key` for `key`, remembered (bounded, whatever names a caller invents)."""
    encoded = text(0x0A, key)
    if len(_keys) < 4096:
        _keys[key] = encoded
    return encoded
