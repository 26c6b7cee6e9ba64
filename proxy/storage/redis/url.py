"""What a `storage:` URL names: this process's memory, one Redis server, the Redis primary that
Redis Sentinel points at, or a Redis Cluster. Parsed at policy load, so a wrong URL is an error
naming the key."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Final
from urllib.parse import parse_qs, parse_qsl, unquote, urlencode, urlsplit

from redis.asyncio.connection import URL_QUERY_ARGUMENT_PARSERS, Connection, parse_url

__all__ = [
    "CLUSTER_SCHEMES",
    "SENTINEL_SCHEME",
    "ClusterURL",
    "SentinelURL",
    "check_storage_url",
    "is_cluster_url",
    "is_redis_url",
    "parse_cluster_url",
    "parse_sentinel_url",
    "shown_url",
]

SENTINEL_SCHEME: Final = "redis+sentinel://"
CLUSTER_SCHEMES: Final = ("redis+cluster://", "rediss+cluster://")
_REDIS_SCHEMES: Final = ("redis://", "rediss://", "unix://", SENTINEL_SCHEME, *CLUSTER_SCHEMES)
_SENTINEL_PORT: Final = 26379
_REDIS_PORT: Final = 6379
_SENTINEL_FORM: Final = "redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]"
_CLUSTER_FORM: Final = "redis+cluster://[[user]:password@]host:port[,host:port...][/0]"
# The `?options` redis-py reads from a one-server URL: any other name it hands to its connection
# class, as it does a name that class does not take (`ssl_*` off rediss://), and that class then
# fails the first call.
_URL_OPTIONS: Final = frozenset(URL_QUERY_ARGUMENT_PARSERS) | {
    "client_name", "username", "password", "ssl_keyfile", "ssl_certfile", "ssl_cert_reqs",
    "ssl_ca_certs", "ssl_ca_data", "ssl_ca_path", "ssl_ciphers", "ssl_password",
}  # fmt: skip
_POOL_OPTIONS: Final = frozenset({"max_connections", "timeout"})


@dataclass(frozen=True, slots=True)
class SentinelURL:
    """Sentinels to ask, the service (`sentinel monitor <service> ...`) and how to log in to its
    primary; the sentinels themselves are reached without a password."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None


@dataclass(frozen=True, slots=True)
class ClusterURL:
    """Nodes to discover a Redis Cluster from (any of its nodes; the client learns the rest),
    how to log in to every node, and whether to speak TLS (`rediss+cluster://`)."""

    nodes: tuple[tuple[str, int], ...]
    tls: bool = False
    username: str | None = None
    password: str | None = None


@dataclass(frozen=True, slots=True)
class _Parts:
    hosts: tuple[tuple[str, int], ...]
    path: str
    username: str | None
    password: str | None


def is_redis_url(url: str) -> bool:
    return url.startswith(_REDIS_SCHEMES)


def is_cluster_url(url: str) -> bool:
    return url.startswith(CLUSTER_SCHEMES)


def shown_url(url: str) -> str:
    """A storage or ledger URL as it may be shown (printed, logged): its login as `***@` and
    the value of a `password` option as `***`, the rest as written."""
    if not is_redis_url(url):
        return url  # memory, sqlite:///path: no secret in them
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    query = parts.query
    if "password" in query:
        options = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, "***" if "password" in k else v) for k, v in options], safe="*")
    return parts._replace(netloc=netloc, query=query).geturl()


def check_storage_url(url: str) -> str:
    """`url` if it is `memory` or a Redis URL this gateway can open, else ValueError."""
    if url.startswith(SENTINEL_SCHEME):
        parse_sentinel_url(url)
    elif is_cluster_url(url):
        parse_cluster_url(url)
    elif is_redis_url(url):
        _check_one_server(url)
    elif url != "memory":
        raise ValueError(
            "storage is memory, redis://host:port/db, rediss://..., unix:///path, "
            f"{_SENTINEL_FORM}, or {_CLUSTER_FORM} (rediss+cluster:// with TLS)"
        )
    return url


def _check_one_server(url: str) -> None:
    """Refuse what redis-py would take here and fail on later (`serve` dying on a traceback at
    its first call, or the database silently 0): a host or port it cannot read, an option's
    value, an unknown option, a database that is not a number. Messages never repeat the URL,
    nor any part of its login."""
    _check_login_encoded(url.partition("://")[2])
    try:
        options = parse_url(url)
    except ValueError as exc:
        raise ValueError(f"a Redis URL redis-py cannot read: {exc}") from None
    parts = urlsplit(url)
    known = _URL_OPTIONS & (_POOL_OPTIONS | _taken_by(options.get("connection_class", Connection)))
    for name in parse_qs(parts.query, keep_blank_values=True):
        if name.startswith("ssl_") and parts.scheme != "rediss":
            raise ValueError(f"a Redis URL takes {name} only with TLS, rediss://")
        if name not in known:
            raise ValueError(
                f"a Redis URL takes no option {name!r}; it takes {', '.join(sorted(known))}"
            )
    db = "" if parts.scheme == "unix" else parts.path.strip("/")
    if db and not db.isdigit():
        raise ValueError(f"the database after the host is a number, got {db!r}")


def _taken_by(connection_class: type) -> frozenset[str]:
    """The keyword arguments `connection_class` and the classes it extends take."""
    names: set[str] = set()
    for cls in connection_class.__mro__:
        if "__init__" in vars(cls):
            names.update(inspect.signature(vars(cls)["__init__"]).parameters)
    return frozenset(names)


def parse_sentinel_url(url: str) -> SentinelURL:
    """`redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]`."""
    if not url.startswith(SENTINEL_SCHEME):
        raise ValueError(f"a Sentinel URL starts with {SENTINEL_SCHEME}")
    parts = _split(url.removeprefix(SENTINEL_SCHEME), "Sentinel", _SENTINEL_FORM, _SENTINEL_PORT)
    service, _, db = parts.path.partition("/")
    if not service:
        raise ValueError(f"a Sentinel URL names its service after the hosts: {_SENTINEL_FORM}")
    db = db.rstrip("/")
    if db and not db.isdigit():
        raise ValueError(f"the database after the service is a number, got {db!r}")
    return SentinelURL(parts.hosts, unquote(service), int(db or 0), parts.username, parts.password)


def parse_cluster_url(url: str) -> ClusterURL:
    """`redis+cluster://[[user]:password@]host[:port][,host[:port]...][/0]`, or
    `rediss+cluster://...` for TLS; the port defaults to 6379."""
    scheme = next((s for s in CLUSTER_SCHEMES if url.startswith(s)), None)
    if scheme is None:
        raise ValueError(f"a Redis Cluster URL starts with {' or '.join(CLUSTER_SCHEMES)}")
    parts = _split(url.removeprefix(scheme), "Redis Cluster", _CLUSTER_FORM, _REDIS_PORT)
    if parts.path.rstrip("/") not in ("", "0"):
        raise ValueError(f"a Redis Cluster has only database 0, got /{parts.path}")
    tls = scheme.startswith("rediss")
    return ClusterURL(parts.hosts, tls, parts.username, parts.password)


def _split(rest: str, what: str, form: str, default_port: int) -> _Parts:
    """`[[user]:password@]host[:port][,host[:port]...][/path]`, after the scheme."""
    _check_login_encoded(rest)
    if "?" in rest or "#" in rest:
        raise ValueError(f"a {what} URL takes no query or fragment: {form}")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    found = tuple(_host_port(part, what, form, default_port) for part in hosts.split(","))
    return _Parts(found, path, username, password)


def _check_login_encoded(rest: str) -> None:
    """Refuse a login with a bare `/`, `?` or `#` (a generated password's, say): the URL would
    end its hosts there, and an error about the host or port read would quote the password."""
    hosts = rest.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0]
    after = rest[len(hosts) :]
    # Not a socket's path (`unix:///run/redis@6379.sock`) nor an option (`?client_name=a@b`).
    cut_login = bool(hosts) and "@" not in hosts and "=" not in after.partition("@")[0]
    if cut_login and "@" in after:
        raise ValueError(
            "a Redis URL's user or password has a '/', '?' or '#' as it is: percent-encode "
            "them (%2F, %3F, %23; '@' is %40, ':' in a user %3A)"
        )


def _host_port(part: str, what: str, form: str, default_port: int) -> tuple[str, int]:
    if not part:
        raise ValueError(f"a {what} URL lists at least one host: {form}")
    if part.startswith("["):  # [::1]:26379
        host, _, port = part[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = part.partition(":")
    if not host:
        raise ValueError(f"a {what} host is missing in {part!r}")
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"a {what} port is a number from 1 to 65535, got {port!r}")
    return host, int(port) if port else default_port
