"""Span attributes as OTLP `Span.attributes` fields, fast for the values that repeat.

Most of a request span's attributes repeat from one request to the next (operation, model,
tenant, backend, status, port, flags): the direct span path keeps the encoding of each
combination of them (proxy/telemetry/directtrace.py), and this writer keeps any integer or
boolean (key, value) pair's; strings (request ids) and floats (timings, cost) rarely repeat
and are written as they come, a float's key prefix kept. The bytes are
protowire.attributes' (tests/telemetry/test_attrwire.py compares them).
"""

from __future__ import annotations

from collections.abc import Iterable

from proxy.telemetry.protowire import SIZES, attributes, double, encoded_key, varint

__all__ = ["AttributeWriter"]

_TAG = 0x4A  # Span.attributes
_HEAD = bytes((_TAG,))
_Kept = tuple[str, object]


class AttributeWriter:
    """Called from one thread (the event loop). Keeps at most `kept` encodings of each kind;
    when one kind's are full they are dropped and gathered again."""

    __slots__ = ("_bools", "_floats", "_ints", "_keys", "_limit", "_texts")

    def __init__(self, kept: int = 4096) -> None:
        self._limit = kept
        self._keys: dict[str, bytes] = {}  # KeyValue.key fields
        self._floats: dict[str, bytes] = {}  # a float's KeyValue, up to the number
        self._ints: dict[tuple[str, object], bytes] = {}
        self._bools: dict[tuple[str, object], bytes] = {}
        self._texts: dict[tuple[str, object], bytes] = {}  # a string's field up to its bytes

    def pairs(self, items: Iterable[tuple[str, object]]) -> bytes:
        """The fields of `items`, in order; None values are left out."""
        floats, ints = self._floats, self._ints
        parts: list[bytes] = []
        append = parts.append
        for key, value in items:
            if value is None:
                continue
            kind = type(value)
            if kind is float:
                append(floats.get(key) or self._float_prefix(key))
                append(double(value))
            elif kind is int:  # a token count, a status, a port: most are kept already
                append(ints.get((key, value)) or self._pair(key, value))
            elif isinstance(value, str):
                append(self._text(key, value))
            else:
                append(self._pair(key, value))
        return b"".join(parts)

    def _pair(self, key: str, value: object) -> bytes:
        """A value that is not a float, a str or None: integers and booleans kept."""
        kind = type(value)
        if kind is not int and kind is not bool:
            return attributes(_TAG, {key: value})
        kept = self._ints if kind is int else self._bools
        encoded = kept.get((key, value))
        if encoded is None:
            encoded = self._keep(kept, (key, value), attributes(_TAG, {key: value}))
        return encoded

    def _text(self, key: str, value: str) -> bytes:
        data = value.encode()
        head = self._texts.get((key, len(data)))
        if head is None:  # a request id is the same length from request to request
            head = self._keep(self._texts, (key, len(data)), self._text_head(key, len(data)))
        return head + data

    def _text_head(self, key: str, size: int) -> bytes:
        """A string's KeyValue up to its `size` bytes: the key, then AnyValue.string_value."""
        name = self._keys.get(key) or self._key(key)
        body = b"\x0a" + (SIZES[size] if size < 0x80 else varint(size))
        value = len(body) + size
        pair = name + (b"\x12" + SIZES[value] if value < 0x80 else b"\x12" + varint(value))
        whole = len(pair) + value
        return b"".join((_HEAD, SIZES[whole] if whole < 0x80 else varint(whole), pair, body))

    def _key(self, key: str) -> bytes:
        encoded = encoded_key(key)
        if len(self._keys) < self._limit:
            self._keys[key] = encoded
        return encoded

    def _keep(self, kept: dict[_Kept, bytes], key: _Kept, encoded: bytes) -> bytes:
        if len(kept) >= self._limit:
            kept.clear()
        kept[key] = encoded
        return encoded

    def _float_prefix(self, key: str) -> bytes:
        """A float's KeyValue up to its eight bytes: the key, then AnyValue.double_value."""
        pair = encoded_key(key) + b"\x12\x09\x21"
        prefix = _HEAD + varint(len(pair) + 8) + pair
        if len(self._floats) < self._limit:
            self._floats[key] = prefix
        return prefix
