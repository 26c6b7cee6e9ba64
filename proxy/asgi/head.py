"""A response's head written to its cycle as uvicorn's `send` writes it, its headers checked by
table instead of by regular expression.

uvicorn's `send` checks every header of a response's start with two regular expressions (a
name's characters, a value's), lowers its name and looks for the three that frame the answer:
5.7 µs for the dozen headers of a gateway answer, 3.7 of it the 24 searches. Both patterns are
classes of characters, so the bytes they find make two tables for `bytes.translate`, which
drops them: a name is checked once and remembered (a gateway sends the same few), the values
are checked together, joined with a tab (which a value may hold). The same headers are refused.
Under `tokenweir serve` the fast lane's `send` wrapper (proxy/web/requestid.py) hands the start to
`write_head`, which does what uvicorn's `send` does with it and leaves the cycle as that
would; the body still goes through uvicorn's `send`. Whatever `write_head` does not do as
uvicorn would (a start it cannot take, a header a check finds wrong, the access log on) it
leaves to uvicorn's `send`, which answers it as ever. The server lends a cycle only if it has
every field read here (proxy/asgi/direct.py `has_cycle_fields`).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain
from typing import Final

from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    RequestResponseCycle,
)

__all__ = ["write_head"]

# The bytes uvicorn's two patterns (classes of characters) find, as tables for bytes.translate.
_BAD_IN_NAME: Final = bytes(b for b in range(256) if HEADER_RE.search(bytes([b])))
_BAD_IN_VALUE: Final = bytes(b for b in range(256) if HEADER_VALUE_RE.search(bytes([b])))
_FRAMING: Final = frozenset({b"content-length", b"transfer-encoding", b"connection"})
_NO_BODY: Final = (204, 304)
_MAX_NAMES: Final = 256
# Names found sound, as the head writes them (lowered): a gateway sends the same few.
_names: dict[bytes, bytes] = {}


def write_head(
    cycle: RequestResponseCycle, status: int, headers: Iterable[tuple[bytes, bytes]]
) -> bool:
    """Write the start of a response with `status` and `headers` to `cycle`'s transport as
    uvicorn's `send` would, and set the cycle's state as it would; False, having done nothing,
    when it is uvicorn's to do."""
    line = STATUS_LINE.get(status)
    if (
        line is None
        or cycle.response_started
        or cycle.disconnected
        or cycle.flow.write_paused
        or cycle.access_log
    ):
        return False
    content = [line]
    values: list[bytes] = []
    framing: list[tuple[bytes, bytes]] = []
    try:
        for name, value in chain(cycle.default_headers, headers):
            lowered = _names.get(name)
            if lowered is None:
                if len(name.translate(None, _BAD_IN_NAME)) != len(name):
                    return False  # uvicorn's send raises its error for it
                lowered = name.lower()
                if len(_names) < _MAX_NAMES:
                    _names[name] = lowered
            if lowered in _FRAMING:
                framing.append((lowered, value))
            values.append(value)
            content += (lowered, b": ", value, b"\r\n")
        joined = b"\t".join(values)  # a tab, which a value may hold, between them
    except (TypeError, ValueError):  # a header not a pair of bytes: uvicorn's send says so
        return False
    if len(joined.translate(None, _BAD_IN_VALUE)) != len(joined):
        return False
    cycle.response_started = True  # before the framing headers are read, as uvicorn's send does
    cycle.waiting_for_100_continue = False
    closing = False
    for name, value in framing:
        closing = _framing(cycle, name, value) or closing
    if not cycle.keep_alive and not closing:
        content.append(b"connection: close\r\n")
    if (
        cycle.chunked_encoding is None
        and cycle.scope["method"] != "HEAD"
        and status not in _NO_BODY
    ):
        cycle.chunked_encoding = True
        content.append(b"transfer-encoding: chunked\r\n")
    content.append(b"\r\n")
    cycle.transport.write(b"".join(content))
    return True


def _framing(cycle: RequestResponseCycle, name: bytes, value: bytes) -> bool:
    """What a framing header sets, as uvicorn's `send` reads it; True for `connection: close`."""
    if name == b"content-length":
        if cycle.chunked_encoding is None:
            cycle.expected_content_length = int(value.decode())
            cycle.chunked_encoding = False
    elif name == b"transfer-encoding":
        if value.lower() == b"chunked":
            cycle.expected_content_length = 0
            cycle.chunked_encoding = True
    elif b"close" in [token.lower().strip() for token in value.split(b",")]:
        cycle.keep_alive = False
        return True
    return False
