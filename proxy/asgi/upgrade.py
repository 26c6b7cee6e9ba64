"""A request that offers an upgrade the gateway does not make (`Upgrade: h2c`), read as the
HTTP/1.1 request it also is, body and all (RFC 9110 7.8: a server may ignore the offer).

llhttp takes any request with `Connection: upgrade` as the end of HTTP/1.1 on the connection:
it skips the request's body and stops at its end, and uvicorn, which makes no such upgrade,
drops the bytes after it. So `curl --http2` on an http:// URL, Java's RestClient and Ktor
(JetBrains' AI Assistant) sent a body that never reached the app (a 400 `invalid_json`, or a
400 when the body came in a later read). Here the body is parsed by a parser of its own, under
a head that holds its framing alone, and that parser then reads the requests after it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Protocol

import httptools

__all__ = ["ParsedBody", "body_framing", "parser_for_body"]


class ParsedBody(Protocol):
    """The protocol's parser callbacks (uvicorn's HttpToolsProtocol)."""

    def on_message_begin(self) -> None: ...
    def on_url(self, url: bytes) -> None: ...
    def on_header(self, name: bytes, value: bytes) -> None: ...
    def on_headers_complete(self) -> None: ...
    def on_body(self, body: bytes) -> None: ...
    def on_message_complete(self) -> None: ...


def body_framing(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The header that frames the request's body (names lowered, as uvicorn keeps them); None
    when it has none. llhttp has refused a request with both, or two lengths, already."""
    for name, value in headers:
        if name == b"transfer-encoding":
            return b"transfer-encoding: " + value
        if name == b"content-length" and value.strip() not in (b"", b"0"):
            return b"content-length: " + value
    return None


def parser_for_body(protocol: ParsedBody) -> tuple[httptools.HttpRequestParser, bytes]:
    """A parser that reads the body of the request `protocol` parsed last, then the requests
    after it, and the head to feed it first (the bytes after the request's own head follow)."""
    parser = httptools.HttpRequestParser(_BodyThenRequests(protocol))
    with contextlib.suppress(AttributeError):  # as uvicorn sets its own (httptools >= 0.6.3)
        parser.set_dangerous_leniencies(lenient_data_after_close=True)
    return parser, b"POST / HTTP/1.1\r\n"


class _BodyThenRequests:
    """The parser's callbacks: of the first message, made of a head of the body's framing alone,
    only the body and its end go to the protocol; every later message goes to it whole."""

    __slots__ = ("_body", "_protocol")

    def __init__(self, protocol: ParsedBody) -> None:
        self._protocol = protocol
        self._body = True  # the first message, the body of the request before

    def on_message_begin(self) -> None:
        if not self._body:
            self._protocol.on_message_begin()

    def on_url(self, url: bytes) -> None:
        if not self._body:
            self._protocol.on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._body:
            self._protocol.on_header(name, value)

    def on_headers_complete(self) -> None:
        if not self._body:
            self._protocol.on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._protocol.on_body(body)

    def on_message_complete(self) -> None:
        self._body = False
        self._protocol.on_message_complete()
