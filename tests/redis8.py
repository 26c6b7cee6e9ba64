"""A private Redis 8 (vector sets, RediSearch) from ../shared/tools/redis8.sh, on a free port,
and a three-node Redis 8 cluster of the same binaries.

Skipped where the script is absent, failed there under TOKENWEIR_REQUIRE_SHARED=1 (as the shared
data is); the server is stopped by its port when the session ends.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.redis_server import wait_until
from tests.servers import free_port
from tests.shared import REPO_ROOT, _missing

SCRIPT = REPO_ROOT.parent / "shared" / "tools" / "redis8.sh"
_START_LOCK = Path(tempfile.gettempdir()) / "tw-redis8-start.lock"


def _script() -> Path:
    if not SCRIPT.is_file():
        _missing(f"needs {SCRIPT} (Redis 8 with vector sets), present in CI")
    return SCRIPT


@pytest.fixture(scope="session")
def redis8_server() -> Iterator[str]:
    script = _script()
    port = free_port()
    # One start at a time: the first downloads the binaries, and two test workers starting at
    # once would both write them while the other runs them.
    with _START_LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
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


@pytest.fixture(scope="session")
def redis8_cluster_server(
    redis8_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A Redis Cluster of three Redis 8 primaries with RediSearch, from the binaries redis8.sh
    fetched (it started `redis8_server` first); each node is stopped by its PID at the end."""
    # redis8.sh caches its binaries there (its own fixed default)
    binaries = Path(os.environ.get("TW_REDIS8", "/tmp/tw-redis8"))  # noqa: S108
    cli = shutil.which("redis-cli")
    if cli is None:
        pytest.fail("redis-cli is not installed: tests need real Redis (apt-get install redis)")
    nodes: list[tuple[int, subprocess.Popen[bytes]]] = []
    try:
        for _ in range(3):
            port, workdir = free_port(), tmp_path_factory.mktemp("redis8-node")
            command = [
                str(binaries / "redis-server"), "--port", str(port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(workdir),
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-port", str(free_port()),
                "--loadmodule", str(binaries / "redisearch.so"),
            ]  # fmt: skip
            server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            nodes.append((port, server))
        for port, _ in nodes:
            wait_until(lambda port=port: _pings(port), "a Redis 8 cluster node", timeout_s=30)  # type: ignore[misc]
        addresses = [f"127.0.0.1:{port}" for port, _ in nodes]
        subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        wait_until(lambda: all(_formed(port) for port, _ in nodes), "the cluster", timeout_s=30)
        yield "redis+cluster://" + ",".join(addresses)
    finally:
        for _, server in nodes:
            server.terminate()
        for _, server in nodes:
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


@pytest.fixture
def redis8_cluster_url(redis8_cluster_server: str) -> str:
    """The session's Redis 8 cluster, every primary emptied (its indexes too) for this test."""
    for address in redis8_cluster_server.removeprefix("redis+cluster://").split(","):
        with redis.Redis(port=int(address.rsplit(":", 1)[1])) as node:
            node.flushall()
    return redis8_cluster_server


def _pings(port: int) -> bool:
    try:
        with redis.Redis(port=port, socket_timeout=2) as node:
            return bool(node.ping())
    except redis.ConnectionError:
        return False


def _formed(port: int) -> bool:
    with redis.Redis(port=port, socket_timeout=2, decode_responses=True) as node:
        return "cluster_state:ok" in str(node.execute_command("CLUSTER", "INFO"))
