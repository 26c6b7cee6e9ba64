"""A Redis Sentinel topology of real processes on free 127.0.0.1 ports, for failover tests: a
primary, a replica of it, and one sentinel (quorum 1) watching them."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from tests.redis_server import RedisProcess, wait_until
from tests.servers import free_port

SERVICE = "tokenweir"


class SentinelTopology:
    """`url` is the gateway's `storage:`; `primary_url()` the server the sentinel names now.

    The sentinel calls the primary down after `down_after_ms` without an answer, then promotes
    the replica (about a second more here)."""

    def __init__(self, *, down_after_ms: int = 500, failover_timeout_ms: int = 2000) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed: tests need real Redis")
        self._binary = binary
        self.primary = RedisProcess()
        self.replica = RedisProcess(["--replicaof", "127.0.0.1", str(self.primary.port)])
        self.sentinel_port = free_port()
        self.url = f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{SERVICE}/0"
        self._timings = (down_after_ms, failover_timeout_ms)
        self._workdir = tempfile.TemporaryDirectory()
        self._sentinel: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.primary.start()
        self.replica.start()
        wait_until(lambda: _replication(self.replica.url)["master_link_status"] == "up", "replica")
        down_after_ms, failover_timeout_ms = self._timings
        config = Path(self._workdir.name) / "sentinel.conf"  # the sentinel rewrites it
        config.write_text(
            f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {self._workdir.name}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary.port} 1\n"
            f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}\n"
            f"sentinel failover-timeout {SERVICE} {failover_timeout_ms}\n"
        )
        self._sentinel = subprocess.Popen(
            [self._binary, str(config), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # Failover needs a replica the sentinel knows about (it learns them from the primary).
        wait_until(self._knows_the_replica, "sentinel")

    def primary_port(self) -> int:
        with self._sentinel_client() as sentinel:
            _, port = sentinel.sentinel_get_master_addr_by_name(SERVICE)
        return int(port)

    def primary_url(self) -> str:
        return f"redis://127.0.0.1:{self.primary_port()}/0"

    def wait_promoted(self, timeout_s: float = 10.0) -> None:
        """Until the sentinel names the replica primary and the replica acts as one."""

        def promoted() -> bool:
            if self.primary_port() != self.replica.port:
                return False
            return _replication(self.replica.url)["role"] == "master"

        wait_until(promoted, "promotion", timeout_s)

    def close(self) -> None:
        if self._sentinel is not None:
            self._sentinel.terminate()
            self._sentinel.wait(timeout=10)
            self._sentinel = None
        self.replica.close()
        self.primary.close()
        self._workdir.cleanup()

    def _knows_the_replica(self) -> bool:
        with self._sentinel_client() as sentinel:
            return len(sentinel.sentinel_slaves(SERVICE)) == 1

    def _sentinel_client(self) -> redis.Redis:
        return redis.Redis(port=self.sentinel_port, socket_timeout=2, decode_responses=True)


@contextmanager
def sentinel_topology() -> Iterator[SentinelTopology]:
    topology = SentinelTopology()
    try:
        topology.start()
        yield topology
    finally:
        topology.close()


def _replication(url: str) -> dict[str, object]:
    with redis.Redis.from_url(url, socket_timeout=2, decode_responses=True) as client:
        return dict(client.info("replication"))
