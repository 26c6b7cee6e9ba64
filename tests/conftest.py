"""Shared fixtures: a real simulated backend and a real gateway, both on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
import redis

from proxy.app import create_app
from proxy.policy import Policy, parse_policy
from proxy.policy.units import hash_key
from proxy.tools.mock import backend as mockbackend
from tests.redis_cluster import ClusterProcesses, redis_cluster
from tests.redis_sentinel import SentinelTopology
from tests.redis_server import RedisProcess, private_redis
from tests.servers import serve

ALPHA_KEY = "tw-test-alpha"
BETA_KEY = "tw-test-beta"
ADMIN_KEY = "tw-test-admin"
BACKEND_KEY = "backend-secret-key"


def policy_text(backend_url: str, *, extra: str = "", read_timeout: str = "5s") -> str:
    """Two tenants on one backend: alpha may use mock-llm and mock-embed, beta only mock-small."""
    return f"""
storage: memory
admin_keys: [{hash_key(ADMIN_KEY)}]
server: {{max_body_bytes: 64KiB}}
upstream: {{connect_timeout: 2s, read_timeout: {read_timeout}}}
backends:
  - name: mock-a
    url: {backend_url}/v1
    api_key: ${{BACKEND_KEY}}
    models: [mock-llm, mock-small, mock-embed]
models:
  mock-llm: {{price: {{input_per_1m: 0.1, output_per_1m: 0.4}}}}
  mock-small: {{}}
  mock-embed: {{}}
tenants:
  alpha:
    api_keys: [{hash_key(ALPHA_KEY)}]
    models: [mock-llm, mock-embed]
  beta:
    api_keys: ["${{BETA_KEY}}"]
    models: [mock-small]
{extra}"""


def make_policy(backend_url: str, **kwargs: str) -> Policy:
    environ = {"BACKEND_KEY": BACKEND_KEY, "BETA_KEY": BETA_KEY}
    return parse_policy(policy_text(backend_url, **kwargs), file="test.yaml", environ=environ)


@pytest.fixture(scope="session")
def backend_url() -> Iterator[str]:
    """The simulated backend: no TTFT, 2,000 tokens/s per stream so tests run quickly."""
    with serve(mockbackend.create_app(ttft_ms=0, tokens_per_second=2000)) as url:
        yield url


@pytest.fixture(scope="session")
def gateway_url(backend_url: str) -> Iterator[str]:
    with serve(create_app(make_policy(backend_url))) as url:
        yield url


@pytest.fixture
def client(gateway_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway_url + "/v1", api_key=ALPHA_KEY, max_retries=0) as sdk:
        yield sdk


@pytest.fixture
def anyio_backend() -> str:
    """Async tests run on asyncio, as the gateway does."""
    return "asyncio"


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """One private redis-server for the session (tests fail, never skip, without redis-server)."""
    server = RedisProcess()
    server.start()
    try:
        yield server.url
    finally:
        server.close()


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """The session's Redis, emptied for this test."""
    with redis.Redis.from_url(redis_server) as admin:
        admin.flushdb()
    return redis_server


@pytest.fixture(scope="session")
def redis_unix_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One private redis-server for the session that also listens on a Unix socket; yields
    its unix:// URL (the socket is only for this test run's user)."""
    with private_redis(tmp_path_factory.mktemp("redis-unix") / "redis.sock") as url:
        yield url


@pytest.fixture
def redis_unix_url(redis_unix_server: str) -> str:
    """The session's Redis over its Unix socket, emptied for this test."""
    with redis.Redis.from_url(redis_unix_server) as admin:
        admin.flushdb()
    return redis_unix_server


@pytest.fixture(scope="session")
def redis_cluster_server() -> Iterator[ClusterProcesses]:
    """One private Redis Cluster (three primaries, no replicas) for the session."""
    with redis_cluster() as cluster:
        yield cluster


@pytest.fixture
def redis_cluster_url(redis_cluster_server: ClusterProcesses) -> str:
    """The session's Redis Cluster, emptied for this test: data and scripts, as a new one."""
    redis_cluster_server.flush()
    return redis_cluster_server.url


@pytest.fixture(scope="session")
def redis_sentinel_server() -> Iterator[SentinelTopology]:
    """One private Sentinel topology (a primary, its replica, a sentinel) for the session; slow
    to call a primary down, so a loaded machine does not fail it over between tests."""
    topology = SentinelTopology(down_after_ms=10_000)
    try:
        topology.start()
        yield topology
    finally:
        topology.close()


@pytest.fixture
def redis_sentinel_url(redis_sentinel_server: SentinelTopology) -> str:
    """The session's Sentinel-named primary, emptied for this test."""
    with redis.Redis.from_url(redis_sentinel_server.primary_url()) as admin:
        admin.flushdb()
    return redis_sentinel_server.url


@pytest.fixture(params=["memory", "redis", "redis-unix", "redis-sentinel", "redis-cluster"])
def storage_url(request: pytest.FixtureRequest) -> str:
    """`memory`, or a real Redis (over TCP or its Unix socket), Sentinel-named primary or Redis
    Cluster emptied for this test: a storage contract test taking it runs once on each."""
    if request.param == "memory":
        return "memory"
    url: str = request.getfixturevalue(f"{request.param.replace('-', '_')}_url")
    return url


@pytest.fixture
def backend(backend_url: str) -> Iterator[httpx.Client]:
    """Raw access to the simulated backend, its counters reset."""
    with httpx.Client(base_url=backend_url, timeout=10) as raw:
        raw.post("/mock/stats/reset").raise_for_status()
        yield raw
