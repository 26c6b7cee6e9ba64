"""What a `storage:` URL names: this process's memory, one Redis server, or the Redis primary that
Redis Sentinel points at. Parsed at policy load, so a wrong URL is an error naming the key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final
from urllib.parse import unquote

__all__ = [
    "SENTINEL_SCHEME",
    "SentinelURL",
    "check_storage_url",
    "is_redis_url",
    "parse_sentinel_url",
]

SENTINEL_SCHEME: Final = "redis+sentinel://"
_REDIS_SCHEMES: Final = ("redis://", "rediss://", "unix://", SENTINEL_SCHEME)
_SENTINEL_PORT: Final = 26379
_SENTINEL_FORM: Final = "redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]"


@dataclass(frozen=True, slots=True)
class SentinelURL:
    """Sentinels to ask, the service (`sentinel monitor <service> ...`) and how to log in to its
    primary; the sentinels themselves are reached without a password."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None


def is_redis_url(url: str) -> bool:
    return url.startswith(_REDIS_SCHEMES)


def check_storage_url(url: str) -> str:
    """`url` if it is `memory` or a Redis URL this gateway can open, else ValueError."""
    if url.startswith(SENTINEL_SCHEME):
        parse_sentinel_url(url)
    elif url != "memory" and not is_redis_url(url):
        raise ValueError(
            "storage is memory, redis://host:port/db, rediss://..., unix:///path, "
            f"or {_SENTINEL_FORM}"
        )
    return url


def parse_sentinel_url(url: str) -> SentinelURL:
    """`redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]`."""
    if not url.startswith(SENTINEL_SCHEME):
        raise ValueError(f"a Sentinel URL starts with {SENTINEL_SCHEME}")
    rest = url.removeprefix(SENTINEL_SCHEME)
    if "?" in rest or "#" in rest:
        raise ValueError(f"a Sentinel URL takes no query or fragment: {_SENTINEL_FORM}")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    sentinels = tuple(_host_port(part) for part in hosts.split(","))
    service, _, db = path.partition("/")
    if not service:
        raise ValueError(f"a Sentinel URL names its service after the hosts: {_SENTINEL_FORM}")
    db = db.rstrip("/")
    if db and not db.isdigit():
        raise ValueError(f"the database after the service is a number, got {db!r}")
    return SentinelURL(sentinels, unquote(service), int(db or 0), username, password)


def _host_port(part: str) -> tuple[str, int]:
    if not part:
        raise ValueError(f"a Sentinel URL lists at least one host: {_SENTINEL_FORM}")
    if part.startswith("["):  # [::1]:26379
        host, _, port = part[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = part.partition(":")
    if not host:
        raise ValueError(f"a Sentinel host is missing in {part!r}")
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"a Sentinel port is a number from 1 to 65535, got {port!r}")
    return host, int(port) if port else _SENTINEL_PORT
