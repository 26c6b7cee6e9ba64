"""The request path's httpx objects, built past httpx's constructors, are the constructors' own:
every attribute the same, and they behave the same where the gateway and httpx read them."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from proxy.upstream.prebuilt import (
    declared_length,
    header_bytes,
    headers_of,
    post_request,
    response_of,
)

URL = httpx.URL("http://127.0.0.1:8000/v1/chat/completions")
BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
HEADER_SETS = [
    [],
    [(b"Host", b"127.0.0.1:8000"), (b"content-type", b"application/json")],
    [(b"X-Request-ID", b"req_1"), (b"x-request-id", b"req_2"), (b"Content-Length", b"57")],
    [(b"x-name", "café".encode()), (b"x-latin", b"\xe9t\xe9")],  # utf-8, then iso-8859-1
]


class _Stream(httpx.AsyncByteStream):
    async def __aiter__(self) -> Any:
        yield b"data"


def _attributes(value: Any) -> dict[str, Any]:
    """An httpx object's attributes, with headers and byte streams as what they hold."""
    found = dict(vars(value))
    for name, held in found.items():
        if isinstance(held, httpx.Headers):
            found[name] = (type(held), vars(held), held.encoding)
        elif isinstance(held, httpx.ByteStream):
            found[name] = (type(held), vars(held))
    return found


@pytest.mark.parametrize("raw", HEADER_SETS)
def test_headers_are_httpx_own(raw: list[tuple[bytes, bytes]]) -> None:
    ours, theirs = headers_of(raw), httpx.Headers(raw)
    assert type(ours) is httpx.Headers
    assert vars(ours) == vars(theirs)
    assert ours.encoding == theirs.encoding
    assert ours.multi_items() == theirs.multi_items()
    assert ours.raw == raw


@pytest.mark.parametrize("raw", HEADER_SETS)
def test_a_request_is_what_the_constructor_makes_and_reads(raw: list[tuple[bytes, bytes]]) -> None:
    extensions = {"timeout": {"read": 5.0}}
    ours = post_request(URL, raw, BODY, extensions)
    theirs = httpx.Request(
        "POST", URL, headers=raw, stream=httpx.ByteStream(BODY), extensions=extensions
    )
    theirs.read()
    assert type(ours) is httpx.Request
    assert _attributes(ours) == _attributes(theirs)
    assert ours.content == BODY
    assert list(ours.stream) == [BODY]  # type: ignore[arg-type]
    assert ours.headers.raw == raw


@pytest.mark.parametrize("raw", HEADER_SETS)
def test_a_response_is_what_the_constructor_makes(raw: list[tuple[bytes, bytes]]) -> None:
    stream = _Stream()
    extensions = {"http_version": b"HTTP/1.1", "reason_phrase": b"OK"}
    ours = response_of(200, raw, stream, extensions)
    theirs = httpx.Response(200, headers=raw, stream=stream, extensions=extensions)
    assert type(ours) is httpx.Response
    assert _attributes(ours) == _attributes(theirs)
    assert ours.http_version == "HTTP/1.1"
    assert ours.reason_phrase == "OK"
    request = httpx.Request("POST", URL)
    ours.request = request
    assert ours.request is request


@pytest.mark.anyio
async def test_a_response_reads_its_stream_once() -> None:
    response = response_of(200, [(b"content-type", b"text/plain")], _Stream(), {})
    assert await response.aread() == b"data"
    assert response.is_stream_consumed
    assert response.text == "data"


@pytest.mark.parametrize(
    ("raw", "length"),
    [
        ([(b"Content-Length", b"120")], 120),
        ([(b"content-type", b"x"), (b"content-length", b"0")], 0),
        ([], None),
        ([(b"content-length", b"5"), (b"Content-Length", b"5")], None),  # several: not trusted
        ([(b"content-length", b"+5")], None),
        ([(b"content-length", b"")], None),
        ([(b"content-length", b"\xc2\xb2")], None),  # '²' is a digit to str.isdigit
        ([(b"x-content-length", b"7")], None),
    ],
)
def test_the_declared_length(raw: list[tuple[bytes, bytes]], length: int | None) -> None:
    assert declared_length(headers_of(raw)) == length
    assert declared_length(httpx.Headers(raw)) == length


@pytest.mark.parametrize("raw", HEADER_SETS)
@pytest.mark.parametrize("name", ["x-request-id", "content-type", "host", "x-name", "absent"])
def test_a_header_read_as_bytes_is_what_get_reads(
    raw: list[tuple[bytes, bytes]], name: str
) -> None:
    headers = httpx.Headers(raw)
    found = header_bytes(headers, name.encode())
    assert found.decode(headers.encoding) == headers.get(name, "")
