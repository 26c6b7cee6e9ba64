"""The usage ledger: one record per request, appended off the request path, queried as totals."""

from __future__ import annotations

from pathlib import Path

from proxy.ledger.base import (
    Bucket,
    GroupBy,
    Ledger,
    LedgerError,
    LedgerStats,
    UsageQuery,
    UsageRecord,
    UsageRow,
)
from proxy.ledger.redis import RedisLedger
from proxy.ledger.sqlite import SqliteLedger
from proxy.policy.units import split_sqlite_url
from proxy.storage.redis.link import RedisLink
from proxy.storage.redis.url import check_storage_url, is_redis_url

__all__ = [
    "Bucket",
    "GroupBy",
    "Ledger",
    "LedgerError",
    "LedgerStats",
    "RedisLedger",
    "SqliteLedger",
    "UsageQuery",
    "UsageRecord",
    "UsageRow",
    "open_ledger",
]


def open_ledger(
    url: str,
    *,
    storage_url: str | None = None,
    read_only: bool = False,
    link: RedisLink | None = None,
) -> Ledger:
    """The ledger named by a policy's `ledger:` value; call `start()` on it before use.

    `sqlite:///relative.db` or `sqlite:////absolute/path.db`, either with `?keep_records=90d`
    (raw records older are deleted; the totals stay); `redis://host:port/db` (or any
    Redis URL `storage:` takes); or `redis`, meaning the policy's Redis `storage:` URL, passed
    as `storage_url`. `read_only` ledgers only answer queries and never create anything.
    `link` is the storage's: a Redis ledger on its URL writes and reads through it (and its
    owner closes it after the ledger); one on another Redis opens connections of its own.
    """
    if url == "redis":
        if storage_url is None or not is_redis_url(storage_url):
            raise ValueError(
                "ledger: redis means the Redis named by storage:, but storage is "
                f"{storage_url or 'not set'}; use a redis:// URL or a sqlite:/// path"
            )
        url = storage_url
    if is_redis_url(url):
        shared = link if link is not None and link.url == url else None
        return RedisLedger(check_storage_url(url), link=shared, read_only=read_only)
    if url.startswith("sqlite:///"):
        path, keep_records_s = split_sqlite_url(url)
        if not path or path == ":memory:":
            raise ValueError(
                f"a sqlite ledger needs a file path, as in sqlite:///tokenweir.db: {url}"
            )
        return SqliteLedger(Path(path), read_only=read_only, keep_records_s=keep_records_s)
    raise ValueError(
        f"unknown ledger {_without_secrets(url)!r}: use sqlite:///relative/path.db, "
        "sqlite:////absolute/path.db, redis://host:port/db, or redis (the storage: Redis)"
    )


def _without_secrets(url: str) -> str:
    """`url` as an error may repeat it: without a login (`user:password@`) or a query."""
    scheme, named, rest = url.partition("://")
    if not named:
        return url
    where = rest.partition("?")[0].partition("#")[0]
    host, slash, path = where.partition("/")
    return f"{scheme}://{host.rpartition('@')[2]}{slash}{path}"
