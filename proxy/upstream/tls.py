"""TLS to https backends: which certificates are trusted (one rule for every client that calls a
backend), and why a handshake or a record failed, in words a client may read."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from typing import Final

import httpx

__all__ = ["TlsBroken", "backend_ssl_context", "causes", "tls_reason"]

# OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH and X509_V_ERR_IP_ADDRESS_MISMATCH: their messages
# quote the backend's host, which is the operator's to see, not a client's.
_HOST_MISMATCH: Final = frozenset({62, 64})


class TlsBroken(httpx.ReadError):
    """The backend's TLS records could not be read (a bad record, an alert) after the handshake."""


def backend_ssl_context() -> ssl.SSLContext:
    """What https backends are checked against: certifi's CAs, or the file `SSL_CERT_FILE` (or
    directory `SSL_CERT_DIR`) names instead, as httpx's own transport reads them; the same for
    the requests, the readiness probe, the semantic cache's embedder and its verifier."""
    return httpx.create_ssl_context(trust_env=True)


def tls_reason(exc: BaseException) -> str | None:
    """Why TLS failed, if an `ssl` error caused `exc`: words a client may read (no host name)."""
    cause = next((c for c in causes(exc) if isinstance(c, ssl.SSLError)), None)
    if cause is None:
        return None
    if isinstance(cause, ssl.SSLCertVerificationError):
        if cause.verify_code in _HOST_MISMATCH:
            detail = "it is not valid for the backend's host name"
        else:
            detail = str(cause.verify_message or cause.reason)
        return f"its TLS certificate was refused: {detail}"
    reason = str(cause.reason or type(cause).__name__).lower().replace("_", " ")
    return f"TLS failed: {reason}"


def causes(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then what caused it (`__cause__`, else `__context__`), each once: a chain may loop."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        yield cause
        cause = cause.__cause__ or cause.__context__
