"""Ledger fixtures: every contract test runs against SQLite, a real, private Redis and a real
Redis Cluster (the session's, from tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(params=["sqlite", "redis", "redis-cluster"])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    url: str = request.getfixturevalue(f"{request.param.replace('-', '_')}_url")
    return url
