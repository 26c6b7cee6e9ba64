"""`open_ledger`: a policy's `ledger:` value to a store, or an error saying what is accepted."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from proxy.ledger import RedisLedger, SqliteLedger, open_ledger


@pytest.mark.parametrize(
    ("url", "path"),
    [
        ("sqlite:///tokenweir.db", Path("tokenweir.db")),
        ("sqlite:///data/usage.db", Path("data/usage.db")),
        ("sqlite:////var/lib/tokenweir/usage.db", Path("/var/lib/tokenweir/usage.db")),
    ],
)
def test_sqlite_urls(url: str, path: Path) -> None:
    ledger = open_ledger(url)
    assert isinstance(ledger, SqliteLedger)
    assert ledger.path == path


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "rediss://cache.internal:6380/2"])
def test_redis_urls(url: str) -> None:
    ledger = open_ledger(url)
    assert isinstance(ledger, RedisLedger)
    assert ledger.url == url


def test_redis_means_the_storage_redis() -> None:
    ledger = open_ledger("redis", storage_url="redis://10.0.0.5:6379/1")
    assert isinstance(ledger, RedisLedger)
    assert ledger.url == "redis://10.0.0.5:6379/1"


@pytest.mark.parametrize(
    ("url", "storage", "message"),
    [
        ("postgres://db/usage", None, "unknown ledger 'postgres://db/usage': use sqlite:///"),
        ("tokenweir.db", None, "unknown ledger 'tokenweir.db'"),
        ("sqlite:///", None, "a sqlite ledger needs a file"),
        ("sqlite:///:memory:", None, "a sqlite ledger needs a file"),
        ("redis", None, "storage is not set"),
        ("redis", "memory", "storage is memory"),
    ],
)
def test_unusable_values_are_explained(url: str, storage: str | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        open_ledger(url, storage_url=storage)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("postgres://usage:hunter2@db/usage", "unknown ledger 'postgres://db/usage'"),
        ("postgres://db/usage?password=hunter2", "unknown ledger 'postgres://db/usage'"),
        ("redis://:hunter2@127.0.0.1:6379/0?sockettimeout=1", "no option 'sockettimeout'"),
    ],
)
def test_a_ledger_url_refused_is_not_repeated_with_its_password(url: str, message: str) -> None:
    """`tokenweir report --ledger` printed the first whole, password and all, and died on a
    TypeError traceback from redis-py at the second's first call."""
    with pytest.raises(ValueError, match=re.escape(message)) as refused:
        open_ledger(url)
    assert "hunter2" not in str(refused.value)
