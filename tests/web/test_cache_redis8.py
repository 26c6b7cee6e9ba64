"""The semantic cache on Redis 8's own vector search (RediSearch's FT.SEARCH, `auto`'s choice, and
the vector sets), end to end: gateway processes sharing one index, tenants and conversations kept
apart, and the verifier against the mock's /v1/rerank."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import httpx
import pytest
import redis

from proxy.app import create_app
from proxy.policy.model import VerifierSpec
from proxy.tools.mock import backend as mockbackend
from tests.conftest import ALPHA_KEY
from tests.redis8 import redis8_server, redis8_url
from tests.servers import replicas, serve
from tests.web.test_cache import COLLIDE_A_KEY, COLLIDE_AB_KEY, ask, cache_policy

__all__ = ["redis8_server", "redis8_url"]  # fixtures

EMBED = "embedder: {model: mock-embed, timeout: 2s}"
SEMANTIC = "{mode: semantic, similarity: 0.95}"
REWORDED = [{"role": "user", "content": "  what is the capital of   FRANCE? "}]
# cache.vector_search, and the keys its Redis engine keeps: FT.SEARCH a hash per vector, beside
# its entry; vector sets one set per partition
ENGINES = [
    pytest.param("auto", "tw:*:cache:f:*", id="search"),
    pytest.param("redis-vsets", "tw:*:cache:s:*", id="vsets"),
]


def semantic(vector_search: str) -> str:
    return f"{{mode: semantic, similarity: 0.95, vector_search: {vector_search}}}"


def redis_vectors(url: str, pattern: str) -> list[bytes]:
    with redis.Redis.from_url(url) as admin:
        return sorted(admin.scan_iter(match=pattern))


def hit_within(url: str, key: str = ALPHA_KEY, *, timeout_s: float = 5.0) -> httpx.Response:
    """The reworded question, asked until a hit: the vector is written off the answer's path."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = ask(url, key, messages=REWORDED)
        if answer.headers["x-tokenweir-cache"] != "miss" or time.monotonic() > deadline:
            return answer
        time.sleep(0.05)


@pytest.mark.parametrize(("vector_search", "pattern"), ENGINES)
def test_gateway_processes_share_one_index_and_a_restarted_one_hits_at_once(
    backend_url: str, redis8_url: str, tmp_path: Path, vector_search: str, pattern: str
) -> None:
    config = tmp_path / "policy.yaml"
    policy = cache_policy(backend_url, redis8_url, semantic(vector_search), embedder=EMBED)
    config.write_text(policy.model_dump_json(), encoding="utf-8")  # JSON is YAML
    with replicas(config, 2) as [(_, one), (_, two)]:
        assert ask(one).headers["x-tokenweir-cache"] == "miss"
        through_two = hit_within(two)
    assert through_two.headers["x-tokenweir-cache"] == "semantic-hit"
    assert len(redis_vectors(redis8_url, pattern)) == 1  # in Redis, none rebuilt in processes
    other = {"tw:*:cache:f:*", "tw:*:cache:s:*"} - {pattern}
    assert redis_vectors(redis8_url, other.pop()) == []  # the one engine chosen, not both
    with redis.Redis.from_url(redis8_url) as admin:
        assert not list(admin.scan_iter(match="tw:*:cache:v:*"))  # no stream for mirrors
    with replicas(config, 1) as [(_, restarted)]:
        first = ask(restarted, messages=REWORDED)
    assert first.headers["x-tokenweir-cache"] == "semantic-hit"


@pytest.mark.parametrize(("vector_search", "pattern"), ENGINES)
def test_tenants_and_conversations_stay_apart_on_redis_search(
    backend_url: str, redis8_url: str, vector_search: str, pattern: str
) -> None:
    policy = cache_policy(backend_url, redis8_url, semantic(vector_search), embedder=EMBED)
    with serve(create_app(policy)) as url:
        ask(url, COLLIDE_A_KEY)
        assert hit_within(url, COLLIDE_A_KEY).headers["x-tokenweir-cache"] == "semantic-hit"
        other_tenant = ask(url, COLLIDE_AB_KEY, messages=REWORDED)
        alpha = ask(url, messages=REWORDED)
        other_context = ask(
            url, COLLIDE_A_KEY, messages=[{"role": "system", "content": "In French."}, *REWORDED]
        )
    assert other_tenant.headers["x-tokenweir-cache"] == "miss"
    assert alpha.headers["x-tokenweir-cache"] == "miss"
    assert other_context.headers["x-tokenweir-cache"] == "miss"
    vectors = redis_vectors(redis8_url, pattern)
    assert len(vectors) == 4  # "a"'s two conversations, "a:b" and alpha: each missed once
    assert all(name.startswith((b"tw:{a}:", b"tw:{a:b}:", b"tw:{alpha}:")) for name in vectors)


@pytest.mark.parametrize(
    ("threshold", "expected"),
    [(0.4, "semantic-hit"), (0.9, "miss")],  # the mock scores (case-sensitive) word overlap: 0.5
)
def test_the_verifier_confirms_or_rejects_a_candidate(
    backend_url: str, backend: httpx.Client, redis8_url: str, threshold: float, expected: str
) -> None:
    verifier = f"{{backend: mock-a, model: mock-rerank, threshold: {threshold}}}"
    spec = f"{{mode: semantic, similarity: 0.95, verifier: {verifier}}}"
    policy = cache_policy(backend_url, redis8_url, spec, embedder=EMBED)
    with serve(create_app(policy)) as url:
        ask(url)
        time.sleep(0.5)  # the vector is written in the background
        reworded = [{"role": "user", "content": "WHAT IS the capital of France?"}]
        answer = ask(url, messages=reworded)
        last = backend.get("/mock/stats").json()["last_request"]
    assert answer.headers["x-tokenweir-cache"] == expected
    if expected == "miss":  # rejected: the backend answered, after the verifier was asked
        assert last["messages"] == reworded
    else:
        assert last["documents"] == ["What is the capital of France?"]
        assert last["query"] == "WHAT IS the capital of France?"


def test_a_verifier_that_does_not_answer_in_time_is_a_miss(
    backend_url: str, redis8_url: str
) -> None:
    slow = mockbackend.create_app(ttft_ms=5000)
    with serve(slow) as slow_url:
        policy = cache_policy(backend_url, redis8_url, SEMANTIC, embedder=EMBED)
        verifier = VerifierSpec(backend="slow", model="rerank", threshold=0.1, timeout=0.3)
        tenants = {}
        for name, tenant in policy.tenants.items():
            cache = tenant.cache.model_copy(update={"verifier": verifier})
            tenants[name] = tenant.model_copy(update={"cache": cache})
        slow_backend = policy.backends[0].model_copy(
            update={"name": "slow", "url": slow_url + "/v1", "models": ("slow-model",)}
        )
        policy = policy.model_copy(
            update={"tenants": tenants, "backends": (*policy.backends, slow_backend)}
        )
        with serve(create_app(policy)) as url:
            ask(url)
            time.sleep(0.5)
            started = time.monotonic()
            answer = ask(url, messages=REWORDED)
            elapsed_s = time.monotonic() - started
    assert answer.headers["x-tokenweir-cache"] == "miss"
    assert answer.status_code == 200
    assert elapsed_s < 4.0  # the verifier's 5 s were not waited for


def test_redis7_without_the_search_module_serves_semantic_hits_from_the_mirror(
    backend_url: str, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    policy = cache_policy(backend_url, redis_url, semantic("redis-search"), embedder=EMBED)
    with (
        caplog.at_level(logging.WARNING, logger="tokenweir.cache"),
        serve(create_app(policy)) as url,
    ):
        assert ask(url).headers["x-tokenweir-cache"] == "miss"
        reworded = hit_within(url)
    assert reworded.headers["x-tokenweir-cache"] == "semantic-hit"
    assert "cache.vector_search is redis-search but the server has no such" in caplog.text
    assert redis_vectors(redis_url, "tw:*:cache:v:*")  # the mirrors' stream, no index
