"""Span attributes as OTLP `Span.attributes` fields, fast for the values that repeat.

Most of a request span's attributes repeat from one request to the next (operation, model,
tenant, backend, status, port, flags): a group of them is encoded once per combination of
values, and any other integer or boolean (key, value) pair once; strings outside a group
(request ids) and floats (timings, cost) rarely repeat and are written as they come. The
bytes are protowire.attributes' (tests/telemetry/test_attrwire.py compares them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from proxy.telemetry.protowire import SIZES, attributes, double, encoded_key, varint

__all__ = ["AttributeWriter"]

_TAG = 0x4A  # Span.attributes
_HEAD = bytes((_TAG,))
_Kept = TypeVar("_Kept", tuple[str, object], tuple[object, ...])


class AttributeWriter:
    """Called from one thread (the event loop). Keeps at most `kept` encodings of each kind;
    when one kind's are full they are dropped and gathered again."""

    __slots__ = ("_bools", "_floats", "_groups", "_ints", "_keys", "_limit")

    def __init__(self, kept: int = 4096) -> None:
        self._limit = kept
        self._keys: dict[str, bytes] = {}  # KeyValue.key fields
        self._floats: dict[str, bytes] = {}  # a float's KeyValue, up to the number
        self._groups: dict[tuple[object, ...], bytes] = {}
        self._ints: dict[tuple[str, object], bytes] = {}
        self._bools: dict[tuple[str, object], bytes] = {}

    def group(self, keys: tuple[str, ...], values: tuple[object, ...]) -> bytes:
        """The fields of `keys` and their `values`: each combination of values is encoded
        once. The keys, and the type of the value at each place, must not change from one call
        to the next (True == 1 would find 1's encoding)."""
        encoded = self._groups.get(values)
        if encoded is None:
            encoded = self._keep(self._groups, values, self.pairs(zip(keys, values, strict=True)))
        return encoded

    def pairs(self, items: Iterable[tuple[str, object]]) -> bytes:
        """The fields of `items`, in order; None values are left out."""
        parts: list[bytes] = []
        append = parts.append
        for key, value in items:
            kind = type(value)
            if kind is float:
                append((self._floats.get(key) or self._float_prefix(key)) + double(value))
            elif isinstance(value, str):
                append(self._text(key, value))
            elif kind is int or kind is bool:
                kept = self._ints if kind is int else self._bools
                encoded = kept.get((key, value))
                if encoded is None:
                    encoded = self._keep(kept, (key, value), attributes(_TAG, {key: value}))
                append(encoded)
            elif value is not None:
                append(attributes(_TAG, {key: value}))
        return b"".join(parts)

    def _text(self, key: str, value: str) -> bytes:
        data = value.encode()
        size = len(data)
        body = b"\x0a" + (SIZES[size] if size < 0x80 else varint(size)) + data
        size = len(body)
        pair = (self._keys.get(key) or self._key(key)) + (
            b"\x12" + SIZES[size] if size < 0x80 else b"\x12" + varint(size)
        )
        size = len(pair) + size
        return b"".join((_HEAD, SIZES[size] if size < 0x80 else varint(size), pair, body))

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
