"""A Redis Cluster of real processes on free 127.0.0.1 ports, for tests that need one: primaries
(and replicas of them) joined by `redis-cli --cluster create`, each with its own directory."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import ClusterDownError, MovedError
from redis.retry import Retry

from tests.redis_server import RedisProcess, wait_until
from tests.servers import free_port


class ClusterProcesses:
    """`url` is the gateway's `storage:`. Nodes call a silent peer failing after
    `node_timeout_ms`; a replica then takes over its primary's slots (about a second more)."""

    def __init__(self, primaries: int = 3, replicas: int = 0, node_timeout_ms: int = 1000) -> None:
        binary = shutil.which("redis-cli")
        if binary is None:
            pytest.fail("redis-cli is not installed: tests need real Redis (apt-get install redis)")
        self._cli = binary
        self._replicas = replicas
        options = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                   "--cluster-node-timeout", str(node_timeout_ms)]  # fmt: skip
        # The bus port is set, not the default port + 10000 (past 65535 for a high free port).
        self.nodes = [
            RedisProcess([*options, "--cluster-port", str(free_port())])
            for _ in range(primaries * (1 + replicas))
        ]
        self.url = "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        subprocess.run(
            [self._cli, "--cluster", "create", *addresses,
             "--cluster-replicas", str(self._replicas), "--cluster-yes"],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
        wait_until(self._formed, "the cluster", timeout_s=15)

    def admin(self) -> RedisCluster:
        """A client of the whole cluster, as a test reads it."""
        live = next(node for node in self.nodes if _answers(node))
        return RedisCluster(host="127.0.0.1", port=live.port, socket_timeout=2)

    def primary_of(self, key: str) -> RedisProcess | None:
        """The node serving `key`'s slot now (any other node answers MOVED), or None while no
        node does (after a failover, a node whose view has not caught up answers CLUSTERDOWN)."""
        for node in self.nodes:
            if not _answers(node):
                continue
            with _client(node) as client:
                try:
                    client.exists(key)
                except (MovedError, ClusterDownError):
                    continue
                return node
        return None

    def replica_of(self, primary: RedisProcess) -> RedisProcess:
        """A node that replicates `primary` now."""
        for node in self.nodes:
            if node is not primary and _answers(node):
                replication = _info(node, "replication")
                if replication["role"] == "slave" and replication["master_port"] == primary.port:
                    return node
        raise AssertionError(f"no replica of the node on port {primary.port}")

    def fail_over_to(self, replica: RedisProcess) -> None:
        """A manual failover (`CLUSTER FAILOVER` on `replica`): its primary stops taking writes
        until the replica has caught up, then the replica takes its slots and the old primary
        stays up as its replica."""
        with _client(replica) as client:
            client.execute_command("CLUSTER", "FAILOVER")

    def start_migrating(self, slot: int, source: RedisProcess, target: RedisProcess) -> None:
        """Resharding's first step (as `redis-cli --cluster reshard` takes it): `target` imports
        `slot` and `source` migrates it; its keys stay on `source` until `finish_migrating`."""
        with _client(target) as client:
            client.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", _node_id(source))
        with _client(source) as client:
            client.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", _node_id(target))

    def finish_migrating(self, slot: int, source: RedisProcess, target: RedisProcess) -> None:
        """Every key of `slot` moved to `target` (MIGRATE), then every node gives it the slot."""
        with _client(source) as client:
            keys = client.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 10_000)
            if keys:
                client.execute_command(
                    "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys
                )
        owner = _node_id(target)
        for node in self.nodes:
            with _client(node) as client:
                client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", owner)

    def flush(self) -> None:
        """Empty every primary and forget their scripts, as a new cluster would be."""
        for node in self.nodes:
            if _answers(node) and _info(node, "replication")["role"] == "master":
                with _client(node) as client:
                    client.flushall()
                    client.script_flush()

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def _formed(self) -> bool:
        for node in self.nodes:
            if _info(node, "cluster")["cluster_state"] != "ok":
                return False
            replication = _info(node, "replication")
            if replication["role"] == "slave" and replication["master_link_status"] != "up":
                return False
        return True


@contextmanager
def redis_cluster(primaries: int = 3, replicas: int = 0) -> Iterator[ClusterProcesses]:
    cluster = ClusterProcesses(primaries, replicas)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


def _client(node: RedisProcess) -> redis.Redis:
    """No retries: a killed node is refused at once, not after seconds of backing off."""
    return redis.Redis(
        port=node.port, socket_timeout=2, decode_responses=True, retry=Retry(NoBackoff(), 0)
    )


def _node_id(node: RedisProcess) -> str:
    with _client(node) as client:
        return str(client.execute_command("CLUSTER", "MYID"))


def _answers(node: RedisProcess) -> bool:
    try:
        with _client(node) as client:
            return bool(client.ping())
    except redis.ConnectionError:
        return False


def _info(node: RedisProcess, section: str) -> dict[str, object]:
    with _client(node) as client:
        if section == "cluster":
            text = str(client.execute_command("CLUSTER", "INFO"))
            return dict(line.split(":", 1) for line in text.split() if ":" in line)
        return dict(client.info(section))
