"""Integers past 64 bits written again as they were read: orjson reads such an integer as the
nearest float, and writes that float back. A client's, sent to the backend (`seed`, an unknown
field altered); in the cache's key (two seeds one float apart shared an answer); a backend's, in
a stored answer and its replays."""

from __future__ import annotations

import re
from typing import Any, Final

import orjson

__all__ = ["as_written", "past_64_bits"]

Json = dict[str, Any] | list[Any]

# A float orjson writes for an integer past 64 bits: at least 9.2e18, so an exponent of 18 or
# more (orjson writes every float from 1e16 up with one). A literal first: searched as one.
_PAST_64_BITS: Final = re.compile(rb"e\+(?:1[89]|[2-9][0-9]|[0-9]{3})")
# Such an integer has 19 digits or more: each digit read as a 0, nineteen of them in a row.
_DIGITS_AS_ZERO: Final = bytes(0x30 if 0x30 <= byte <= 0x39 else byte for byte in range(256))
_NINETEEN_DIGITS: Final = b"0" * 19
_RUN: Final = re.compile(rb"0+")
# What may stand beside the digits of a float (`1.5`, `2e9`, `.25`): a run there is no integer.
_FLOAT_PARTS: Final = (b".", b"e", b"E")
_MAX_DIGITS: Final = 308  # past a double's range orjson refuses the body (a 400)
_INT64_MIN: Final = -(2**63)
_UINT64_END: Final = 2**64  # orjson reads integers from -2**63 to 2**64 - 1 exactly


def past_64_bits(content: bytes) -> bool:
    """Whether `content`, as orjson wrote it, may hold a float read for an integer past 64 bits:
    a `+` (one memchr), then an exponent of 18 or more."""
    return b"+" in content and _PAST_64_BITS.search(content) is not None


def as_written(content: bytes, body: Json, raw: bytes, option: int = 0) -> bytes:
    """`content` (`body` as orjson wrote it, with `option`), or, where `raw` (the JSON `body`
    was read from) has integers past 64 bits, `body` written again with each as `raw` wrote it.
    Looked for only when `content` has a `+` (one memchr a request): an exponent, or text that
    says `+`; then an exponent of 18 or more, then 19 digits in a row in `raw`."""
    if not past_64_bits(content):
        return content
    digits = raw.translate(_DIGITS_AS_ZERO)
    if _NINETEEN_DIGITS not in digits:
        return content  # `1e+20` in a prompt's text
    written = _big_integers(raw, digits)
    if not written:
        return content  # a float the client wrote so, or text that reads like one
    return orjson.dumps(_restored(body, written), option=option)


def _big_integers(raw: bytes, digits: bytes) -> dict[float, orjson.Fragment]:
    """Each integer of `raw` past 64 bits, by the float orjson read it as: each run of 19 digits
    or more that is no float's part, found at C speed (Python's JSON reader took 150 ms on a
    5 MB body, on the event loop). A run in a string adds a float the body does not hold.
    `digits` is `raw` with each digit a 0."""
    found: dict[float, orjson.Fragment] = {}
    at = digits.find(_NINETEEN_DIGITS)
    while at >= 0:
        run = _RUN.match(digits, at)
        end = run.end() if run is not None else at + len(_NINETEEN_DIGITS)
        start = at - 1 if raw[at - 1 : at] == b"-" else at
        if raw[start - 1 : start] not in _FLOAT_PARTS and raw[end : end + 1] not in _FLOAT_PARTS:
            literal = raw[start:end]
            value = int(literal) if end - at <= _MAX_DIGITS else 0
            if not _INT64_MIN <= value < _UINT64_END:
                found[float(value)] = orjson.Fragment(literal)
        at = digits.find(_NINETEEN_DIGITS, end)
    return found


def _restored(body: Json, written: dict[float, orjson.Fragment]) -> Json:
    """A copy of `body`, level by level, each float orjson read for an integer of `written` as
    that integer's text (the body itself is the request's, read by the ledger and the cache)."""
    copy = body.copy()
    pending: list[Json] = [copy]
    while pending:
        item = pending.pop()
        keys = range(len(item)) if isinstance(item, list) else list(item)
        for key in keys:
            member = item[key]  # type: ignore[index]
            if type(member) is float and member in written:
                item[key] = written[member]  # type: ignore[index]
            elif type(member) is dict or type(member) is list:
                item[key] = member = member.copy()  # type: ignore[index]
                pending.append(member)
    return copy
