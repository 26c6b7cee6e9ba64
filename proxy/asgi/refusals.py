"""The server protocol's own refusals of what never reached the app, in OpenAI's shape."""

from __future__ import annotations

from proxy.errors import BadRequest, HeadersTooLarge

__all__ = ["headers_too_large", "malformed", "too_many_pipelined"]


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


def headers_too_large(limit: int) -> HeadersTooLarge:
    return HeadersTooLarge(
        f"The request line and headers are larger than this gateway accepts ({limit} "
        "bytes, after the first read)."
    )
