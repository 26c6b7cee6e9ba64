"""Posting OTLP/HTTP trace bodies to a collector, as the OTEL_EXPORTER_OTLP_* variables say.

It reads the standard variables (the signal-specific one first, then the general one):
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (used as given) or `OTEL_EXPORTER_OTLP_ENDPOINT` (plus
`/v1/traces`; default `http://localhost:4318`; a login in it is sent as Basic auth, and never
shown), `..._HEADERS` (`k=v,k2=v2`, URL-encoded),
`..._TIMEOUT` (milliseconds, as the specification says; default 10000), `..._COMPRESSION`
(`gzip` or `none`), `..._CERTIFICATE`, `..._CLIENT_CERTIFICATE` and `..._CLIENT_KEY`.
A batch the collector refuses with 429, 502, 503 or 504, or cannot take (connection error),
is retried with back-off until the timeout, waiting at least what its `Retry-After` asks (as
the SDK's exporter does; a wait past the timeout drops the batch at once); any other refusal
drops the batch with a warning.

Posts go over one kept-alive connection with the standard library's `http.client` (a post
costs less than half the CPU it did through httpx: docs/benchmarks.md, "spans posted with
http.client"). An endpoint that is not an http(s) URL drops every batch with a warning. The
`HTTP(S)_PROXY`, `ALL_PROXY` and `NO_PROXY` variables are honoured as httpx and the SDK's
exporter honour them: an `http://` collector is reached through the proxy in absolute form, an
`https://` one through a CONNECT tunnel; NO_PROXY's entries may carry a port, and may be IP
addresses or CIDR networks.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import http.client
import logging
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address, ip_address, ip_network
from urllib.parse import SplitResult, unquote, urlsplit

import certifi

from proxy import __version__
from proxy.upstream.rejection import retry_after_s

__all__ = ["OtlpPoster", "OtlpSettings", "otlp_settings"]

_log = logging.getLogger("tokenweir")
_RETRY_STATUSES = frozenset({429, 502, 503, 504})
# An OTLP answer's body is a few bytes (an ExportTraceServiceResponse); past this much, or
# past the post's deadline, the rest is left unread and the connection closed.
_MAX_ANSWER_BYTES = 64 * 1024


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
    verify: str | bool  # a CA bundle's path, or certifi's CAs (as httpx had)
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
    """Posts encoded ExportTraceServiceRequest bodies from one exporting thread at a time;
    `close` may come from another (it ends a retry's wait, or a post, at once)."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        settings = otlp_settings(environ)
        self.endpoint = without_login(settings.endpoint)  # shown in warnings
        self.timeout_s = settings.timeout_s
        self._gzip = settings.gzip
        self._headers = {
            "content-type": "application/x-protobuf",
            "user-agent": f"tokenweir/{__version__}",
            **_basic_login(urlsplit(settings.endpoint), "authorization"),
            **settings.headers,
        }
        if self._gzip:
            self._headers["content-encoding"] = "gzip"
        self._route = _Route(settings, environ)
        self._headers.update(self._route.headers)
        self._connection: http.client.HTTPConnection | None = None
        self._posting = threading.Lock()
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
            with self._posting:
                problem = self._post(body, deadline)
            if problem is None:
                return True
            retryable, reason, asked_s = problem
            if asked_s is not None:  # the collector's Retry-After: no sooner than it asked
                delay_s = max(delay_s, asked_s)
                reason += f" (Retry-After {asked_s:g} s)"
            if not retryable or time.monotonic() + delay_s >= deadline:
                _log.warning("dropped %d spans: %s at %s", spans, reason, self.endpoint)
                return False
            if self._stopped.wait(delay_s):
                return False
            delay_s *= 2

    def _post(self, body: bytes, deadline: float) -> tuple[bool, str, float | None] | None:
        """None once the collector took the batch, else (worth retrying?, why not, the wait
        its Retry-After asks for)."""
        if self._route.unusable is not None:
            return False, self._route.unusable, None
        timeout_s = max(0.001, deadline - time.monotonic())
        try:
            connection = self._connected(timeout_s)
            connection.request("POST", self._route.target, body, self._headers)
            with connection.getresponse() as answer:
                status = answer.status
                retry_after = answer.getheader("retry-after")
                whole = _drained(answer, connection, deadline)
            if answer.will_close or not whole:
                self._drop()
        except (OSError, http.client.HTTPException) as exc:
            self._drop()
            return True, f"{type(exc).__name__}: {exc}", None
        if 200 <= status < 300:
            return None
        retryable = status in _RETRY_STATUSES
        return retryable, f"HTTP {status}", retry_after_s(retry_after) if retryable else None

    def _connected(self, timeout_s: float) -> http.client.HTTPConnection:
        """The kept-alive connection (unless the collector closed it meanwhile), or a new one;
        its reads and writes time out after `timeout_s`."""
        connection = self._connection
        if connection is not None and connection.sock is not None and _readable(connection.sock):
            self._drop()  # closed by the collector (or it sent what was not asked for)
            connection = None
        if connection is None:
            if self._stopped.is_set():
                raise ConnectionAbortedError("the exporter is closed")
            connection = self._connection = self._route.connection(timeout_s)
        connection.timeout = timeout_s
        if connection.sock is not None:
            connection.sock.settimeout(timeout_s)
        return connection

    def _drop(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    def close(self) -> None:
        self._stopped.set()
        sock = self._connection.sock if self._connection is not None else None
        if sock is not None:  # read once: the posting thread may be closing it meanwhile
            with contextlib.suppress(OSError):  # wakes a post blocked on the collector
                sock.shutdown(socket.SHUT_RDWR)
        with self._posting:
            self._drop()


class _Route:
    """How to reach the collector: straight, or through the proxy the environment names."""

    def __init__(self, settings: OtlpSettings, environ: Mapping[str, str]) -> None:
        url = urlsplit(settings.endpoint)
        usable = url.scheme in ("http", "https") and bool(url.hostname)
        # Why nothing can be posted (the gateway still starts, as the SDK's exporter would).
        self.unusable = None if usable else "the endpoint is not an http:// or https:// URL"
        self._url = url
        self._port = url.port or (443 if url.scheme == "https" else 80)
        self.target = (url.path or "/") + (f"?{url.query}" if url.query else "")
        self._tls = _tls_context(settings) if url.scheme == "https" else None
        self._proxy = _proxy_for(url, environ)
        self.headers: dict[str, str] = {}  # what every request carries for the route
        if self._proxy is not None and self._tls is None:  # absolute form, as to any proxy
            self.target = without_login(settings.endpoint)
            self.headers = _basic_login(self._proxy, "proxy-authorization")

    def connection(self, timeout_s: float) -> http.client.HTTPConnection:
        """A new connection (opened by its first request)."""
        host, port = self._url.hostname or "", self._port
        if self._proxy is None:
            return _connection(host, port, self._tls, timeout_s)
        proxy_host, proxy_port = self._proxy.hostname or "", self._proxy.port or 80
        connection = _connection(proxy_host, proxy_port, self._tls, timeout_s)
        if self._tls is not None:  # CONNECT host:port, then TLS to the collector inside it
            connection.set_tunnel(host, port, _basic_login(self._proxy, "proxy-authorization"))
        return connection


def _connection(
    host: str, port: int, tls: ssl.SSLContext | None, timeout_s: float
) -> http.client.HTTPConnection:
    if tls is not None:
        return http.client.HTTPSConnection(host, port, timeout=timeout_s, context=tls)
    return http.client.HTTPConnection(host, port, timeout=timeout_s)


def _tls_context(settings: OtlpSettings) -> ssl.SSLContext:
    """Verifies the collector with the configured CA bundle (file or directory), else
    certifi's; presents the client certificate if one is configured."""
    verify = settings.verify if isinstance(settings.verify, str) else certifi.where()
    if os.path.isdir(verify):
        context = ssl.create_default_context(capath=verify)
    else:
        context = ssl.create_default_context(cafile=verify)
    if isinstance(settings.cert, tuple):
        context.load_cert_chain(*settings.cert)
    elif settings.cert:
        context.load_cert_chain(settings.cert)
    return context


def _proxy_for(url: SplitResult, environ: Mapping[str, str]) -> SplitResult | None:
    """The http:// proxy `HTTP(S)_PROXY` or `ALL_PROXY` names for `url`, unless `NO_PROXY`
    exempts its host; a proxy of another scheme is not used (a warning says so)."""
    proxies = {
        name[: -len("_proxy")]: value.strip()
        for name, value in ((k.lower(), v) for k, v in environ.items())
        if name.endswith("_proxy") and value.strip()
    }
    address = proxies.get(url.scheme) or proxies.get("all")
    if not address or _bypassed(url, proxies.get("no", "")):
        return None
    proxy = urlsplit(address if "://" in address else f"http://{address}")
    if proxy.scheme != "http" or not proxy.hostname:
        shown = without_login(address)
        _log.warning("OTLP export does not use the proxy %s: only http:// proxies", shown)
        return None
    return proxy


def _bypassed(url: SplitResult, no_proxy: str) -> bool:
    """Whether NO_PROXY exempts `url`, read as the SDK's exporter (requests) reads it: `*`; a
    host or domain (`example.com` covers its subdomains too); an IP address or a network in
    CIDR form (`10.0.0.0/8`); any of these with `:port` exempts that port only (an IPv6
    address with a port in brackets: `[::1]:4318`)."""
    host = (url.hostname or "").lower()
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        address: IPv4Address | IPv6Address | None = ip_address(host)
    except ValueError:
        address = None
    for entry in (e.strip().lower() for e in no_proxy.split(",")):
        if entry == "*":
            return True
        name, only_port = _split_port(entry)
        if not name or (only_port is not None and only_port != port):
            continue
        if address is not None:
            with contextlib.suppress(ValueError):  # not an address: a name never matches one
                if address in ip_network(name, strict=False):
                    return True
            continue
        name = name.lstrip(".")
        if host == name or host.endswith("." + name):
            return True
    return False


def _split_port(entry: str) -> tuple[str, int | None]:
    """A NO_PROXY entry's host (or network) and its port, if it names one."""
    if entry.startswith("["):  # [v6] or [v6]:port
        inside, _, rest = entry[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
        return inside, int(port) if port.isdigit() else None
    name, sep, port = entry.rpartition(":")
    if sep and port.isdigit() and ":" not in name:  # host:port, not a bare IPv6 address
        return name, int(port)
    return entry, None


def without_login(url: str) -> str:
    """`url` without its `user:password@`, to show or to send on (a proxy's request line)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


def _basic_login(url: SplitResult, header: str) -> dict[str, str]:
    """`header` with the URL's `user:password@` as Basic auth, if it has a user name: a proxy's
    `proxy-authorization`, or the endpoint's `authorization`, as the SDK's exporter (requests)
    sends it (`OTEL_EXPORTER_OTLP_HEADERS` may still set its own)."""
    if url.username is None:
        return {}
    login = f"{unquote(url.username)}:{unquote(url.password or '')}".encode()
    return {header: "Basic " + base64.b64encode(login).decode()}


def _drained(
    answer: http.client.HTTPResponse, connection: http.client.HTTPConnection, deadline: float
) -> bool:
    """Read the answer's body, at most _MAX_ANSWER_BYTES and until `deadline`: False if it
    was longer, slower or broken off (a collector streaming a body without end held the
    exporting thread and its memory as long as it went on; one that stalled after its 200 had
    the batch it took posted again)."""
    if answer.length is not None and answer.length > _MAX_ANSWER_BYTES:
        return False
    read = 0
    while read <= _MAX_ANSWER_BYTES:
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            return False
        try:
            if connection.sock is not None:
                connection.sock.settimeout(left_s)
            data = answer.read1(16384)
        except (OSError, http.client.HTTPException):  # its status said all there is to know
            return False
        if not data:
            return True
        read += len(data)
    return False


def _readable(sock: socket.socket) -> bool:
    """Whether an idle kept-alive socket has something to read: the collector closed it
    (poll, not select: the gateway's descriptors go past select's 1024)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))
