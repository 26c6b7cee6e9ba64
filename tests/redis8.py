"""A private Redis 8 (vector sets, RediSearch) from ../shared/tools/redis8.sh, on a free port.

Skipped where the script is absent, failed there under TOKENWEIR_REQUIRE_SHARED=1 (as the shared
data is); the server is stopped by its port when the session ends.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.redis_server import _free_port
from tests.shared import REPO_ROOT, _missing

SCRIPT = REPO_ROOT.parent / "shared" / "tools" / "redis8.sh"


def _script() -> Path:
    if not SCRIPT.is_file():
        _missing(f"needs {SCRIPT} (Redis 8 with vector sets), present in CI")
    return SCRIPT


@pytest.fixture(scope="session")
def redis8_server() -> Iterator[str]:
    script = _script()
    port = _free_port()
    started = subprocess.run(
        ["bash", str(script), "start", str(port)], capture_output=True, text=True, timeout=300
    )
    try:
        if started.returncode != 0:
            pytest.fail(f"redis8.sh could not start Redis 8: {started.stdout}{started.stderr}")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        subprocess.run(["bash", str(script), "stop", str(port)], check=False, timeout=30)


@pytest.fixture
def redis8_url(redis8_server: str) -> str:
    """The session's Redis 8, emptied for this test."""
    with redis.Redis.from_url(redis8_server) as admin:
        admin.flushdb()
    return redis8_server
