"""Ledger fixtures: every contract test runs against SQLite and a real, private Redis."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.ledger.redisproc import RedisProcess

SHARED_REDIS = "redis://127.0.0.1:6379/15"


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """A private redis-server; else db 15 of the local one; else the Redis tests skip."""
    if RedisProcess.available():
        server = RedisProcess().start()
        try:
            yield server.url + "/0"
        finally:
            server.stop()
        return
    try:
        with redis.Redis.from_url(SHARED_REDIS, socket_connect_timeout=1) as client:
            client.ping()
    except redis.ConnectionError:
        pytest.skip("no redis-server binary and no Redis on 127.0.0.1:6379")
    yield SHARED_REDIS


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """The Redis ledger's URL, its database emptied before the test."""
    with redis.Redis.from_url(redis_server) as client:
        client.flushdb()
    return redis_server


@pytest.fixture(params=["sqlite", "redis"])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    url: str = request.getfixturevalue("redis_url")
    return url


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
