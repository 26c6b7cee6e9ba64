"""Posting OTLP/HTTP trace bodies to a collector, as the OTEL_EXPORTER_OTLP_* variables say.

It reads the standard variables (the signal-specific one first, then the general one):
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (used as given) or `OTEL_EXPORTER_OTLP_ENDPOINT` (plus
`/v1/traces`; default `http://localhost:4318`), `..._HEADERS` (`k=v,k2=v2`, URL-encoded),
`..._TIMEOUT` (milliseconds, as the specification says; default 10000), `..._COMPRESSION`
(`gzip` or `none`), `..._CERTIFICATE`, `..._CLIENT_CERTIFICATE` and `..._CLIENT_KEY`.
A batch the collector refuses with 429, 502, 503 or 504, or cannot take (connection error),
is retried with back-off until the timeout; any other refusal drops the batch with a warning.
"""

from __future__ import annotations

import gzip
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote

import httpx

from proxy import __version__

__all__ = ["OtlpPoster", "OtlpSettings", "otlp_settings"]

_log = logging.getLogger("tokenweir")
_RETRY_STATUSES = frozenset({429, 502, 503, 504})


def _setting(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or environ.get(
        f"OTEL_EXPORTER_OTLP_{name}"
    )
    return value.strip() if value and value.strip() else None


def _headers(text: str | None) -> dict[str, str]:
    headers: dict[str, str] = {}
    for pair in (text or "").split(","):
        name, sep, value = pair.partition("=")
        if sep and name.strip():
            headers[unquote(name.strip()).lower()] = unquote(value.strip())
    return headers


@dataclass(frozen=True, slots=True)
class OtlpSettings:
    endpoint: str
    headers: dict[str, str]
    timeout_s: float
    gzip: bool
    verify: str | bool  # a CA bundle's path, or the system's CAs
    cert: str | tuple[str, str] | None


def otlp_settings(environ: Mapping[str, str]) -> OtlpSettings:
    """Where and how to post spans, from the OTEL_* variables."""
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if not endpoint:
        base = (environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://localhost:4318").strip()
        endpoint = base.rstrip("/") + "/v1/traces"
    timeout_ms = _setting(environ, "TIMEOUT")
    certificate = _setting(environ, "CLIENT_CERTIFICATE")
    key = _setting(environ, "CLIENT_KEY")
    return OtlpSettings(
        endpoint=endpoint,
        headers=_headers(_setting(environ, "HEADERS")),
        timeout_s=float(timeout_ms) / 1000.0 if timeout_ms else 10.0,
        gzip=(_setting(environ, "COMPRESSION") or "none").lower() == "gzip",
        verify=_setting(environ, "CERTIFICATE") or True,
        cert=(certificate, key) if certificate and key else certificate,
    )


class OtlpPoster:
    """Posts encoded ExportTraceServiceRequest bodies from one exporting thread; `close` may
    come from another (it ends a retry's wait at once)."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        settings = otlp_settings(environ)
        self.endpoint = settings.endpoint
        self.timeout_s = settings.timeout_s
        self._gzip = settings.gzip
        headers = {
            "content-type": "application/x-protobuf",
            "user-agent": f"tokenweir/{__version__}",
            **settings.headers,
        }
        if self._gzip:
            headers["content-encoding"] = "gzip"
        self._client = httpx.Client(
            headers=headers, timeout=self.timeout_s, verify=settings.verify, cert=settings.cert
        )
        self._stopped = threading.Event()

    def send(self, body: bytes, spans: int, timeout_s: float | None = None) -> bool:
        """Post `body` (holding `spans` spans), retrying within `timeout_s` (default: the
        OTLP timeout, which also bounds it); False, and a warning logged, if the collector
        never took it."""
        if self._stopped.is_set():
            return False
        if self._gzip:
            body = gzip.compress(body, compresslevel=6)
        deadline = time.monotonic() + min(self.timeout_s, timeout_s or self.timeout_s)
        delay_s = 0.5
        while True:
            problem = self._post(body, deadline)
            if problem is None:
                return True
            retryable, reason = problem
            if not retryable or time.monotonic() + delay_s >= deadline:
                _log.warning("dropped %d spans: %s at %s", spans, reason, self.endpoint)
                return False
            if self._stopped.wait(delay_s):
                return False
            delay_s *= 2

    def _post(self, body: bytes, deadline: float) -> tuple[bool, str] | None:
        """None once the collector took the batch, else (worth retrying?, why not)."""
        try:
            answer = self._client.post(
                self.endpoint, content=body, timeout=max(0.001, deadline - time.monotonic())
            )
        except httpx.HTTPError as exc:
            return True, f"{type(exc).__name__}: {exc}"
        if answer.is_success:
            return None
        return answer.status_code in _RETRY_STATUSES, f"HTTP {answer.status_code}"

    def close(self) -> None:
        self._stopped.set()
        self._client.close()
