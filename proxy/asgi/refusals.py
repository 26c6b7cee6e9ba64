"""The server protocol's own refusals of what never reached the app, in OpenAI's shape."""

from __future__ import annotations

from proxy.errors import BadRequest, GatewayError, HeadersTooLarge

__all__ = [
    "head_fault",
    "headers_too_large",
    "host_fault",
    "malformed",
    "oversized",
    "status_line",
    "too_many_pipelined",
]


def too_many_pipelined(limit: int) -> BadRequest:
    return BadRequest(
        f"More than {limit} requests came on one connection before their answers "
        "(pipelined); those before are answered, and the connection is closed.",
        code="too_many_pipelined_requests",
    )


def malformed() -> BadRequest:
    return BadRequest(
        "The request is not valid HTTP/1.1 (its request line, a header, or the framing of its "
        "body: Content-Length, Transfer-Encoding or a chunk); the connection is closed.",
        code="invalid_http_request",
    )


def head_fault(
    url: bytes, headers: list[tuple[bytes, bytes]], reads: int, version: str, limit: int
) -> GatewayError | None:
    """Why a request's line and headers are refused once complete, if they are: over `limit`
    bytes (431; counted only where the `reads` they came in could hold that many), or not
    exactly one `Host` (400)."""
    if reads > limit and oversized(url, headers, limit):
        return headers_too_large(limit)
    return host_fault(headers, version)


def host_fault(headers: list[tuple[bytes, bytes]], http_version: str) -> BadRequest | None:
    """Why a request's `Host` header is wrong, if it is: HTTP/1.1 asks for exactly one (RFC 9112
    3.2: a server answers 400 to none, or to more than one); HTTP/1.0 for at most one."""
    hosts = 0
    for name, _ in headers:
        if name == b"host":
            hosts += 1
    if hosts == 1 or (hosts == 0 and http_version == "1.0"):
        return None
    return BadRequest(
        f"The request has {'no' if hosts == 0 else hosts} Host header{'' if hosts == 0 else 's'}"
        ": HTTP/1.1 asks for exactly one. The connection is closed.",
        code="invalid_host_header",
    )


def headers_too_large(limit: int) -> HeadersTooLarge:
    return HeadersTooLarge(
        f"The request line and headers are larger than this gateway accepts ({limit} bytes)."
    )


def oversized(url: bytes, headers: list[tuple[bytes, bytes]], limit: int) -> bool:
    """Are a request's line and headers, as they came (each `name: value\r\n`), over `limit`?
    For headers whole within a read or two (a read takes up to 256 KiB), which the protocol's
    count of the reads after the first let through."""
    return len(url) + 16 + sum(len(name) + len(value) + 4 for name, value in headers) > limit


def status_line(error: GatewayError) -> bytes:
    """The status line the protocol answers a refusal with."""
    return b"431 Request Header Fields Too Large" if error.status == 431 else b"400 Bad Request"
