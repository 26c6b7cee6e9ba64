"""httpx's request, response and headers built from parts that are already what httpx would make
of them.

The request path builds an `httpx.Request`, an `httpx.Response` and their two `httpx.Headers`
a call, and httpx's constructors check and normalise every part again (ABC checks, two calls a
header) and reading a header scans them all twice: about 55,000 instructions a request more
than building them here, a sixteenth of the bare gateway's (docs/benchmarks.md). Here the parts
are bytes already, so the objects are built directly, with the attributes the constructors give
them. That writes httpx 0.28's own attributes (`Headers._list`, `Request._content`, the
response's): the pin in pyproject.toml keeps that version, and tests/upstream/test_prebuilt.py
compares every attribute with the constructors' objects, so a release that changes them fails
there first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

__all__ = ["declared_length", "header_bytes", "headers_of", "post_request", "response_of"]

_new_headers = httpx.Headers.__new__


def headers_of(raw: Sequence[tuple[bytes, bytes]]) -> httpx.Headers:
    """`httpx.Headers(raw)` for names and values that are bytes: the same list, the encoding
    found on first use, as httpx finds it."""
    headers = _new_headers(httpx.Headers)
    headers._list = [(name, name.lower(), value) for name, value in raw]
    headers._encoding = None
    return headers


def post_request(
    url: httpx.URL, raw: Sequence[tuple[bytes, bytes]], content: bytes, extensions: dict[str, Any]
) -> httpx.Request:
    """`httpx.Request("POST", url, headers=raw, stream=httpx.ByteStream(content),
    extensions=extensions)` already read, as `request.read()` leaves it. The request keeps
    `extensions` itself, not a copy."""
    request = httpx.Request.__new__(httpx.Request)
    request.method = "POST"
    request.url = url
    request.headers = headers_of(raw)
    request.extensions = extensions
    request.stream = httpx.ByteStream(content)
    request._content = content
    return request


def response_of(
    status: int,
    raw: Sequence[tuple[bytes, bytes]],
    stream: httpx.AsyncByteStream,
    extensions: dict[str, Any],
) -> httpx.Response:
    """`httpx.Response(status, headers=raw, stream=stream, extensions=extensions)`, keeping
    `extensions` itself."""
    response = httpx.Response.__new__(httpx.Response)
    response.status_code = status
    response.headers = headers_of(raw)
    response._request = None
    response.next_request = None
    response.extensions = extensions
    response.history = []
    response.is_closed = False
    response.is_stream_consumed = False
    response.default_encoding = "utf-8"
    response.stream = stream
    response._num_bytes_downloaded = 0
    return response


def declared_length(headers: httpx.Headers) -> int | None:
    """The one `content-length` header's value; None without one, with several (joined, they
    are no longer digits), or with one that is not digits."""
    value = header_bytes(headers, b"content-length")
    return int(value) if value.isdigit() else None


def header_bytes(headers: httpx.Headers, name: bytes) -> bytes:
    """The values of the header `name` (lowercase) joined with ", ", as `headers.get` joins
    them, left as bytes (b"" without one): no scan of every header for their encoding."""
    return b", ".join([value for _, lowered, value in headers._list if lowered == name])
