"""The cache section's vector-search keys: engine, HNSW parameters, verifier; errors named."""

from __future__ import annotations

import pytest

from proxy.policy import PolicyError, parse_policy
from proxy.policy.model import HnswSpec


def policy(cache: str) -> str:
    return f"""
backends: [{{name: vllm, url: http://127.0.0.1:8000/v1, models: [m, reranker]}}]
models: {{m: {{}}, reranker: {{}}}}
tenants:
  t:
    api_keys: [sha256:{"0" * 64}]
    models: [m]
    cache: {cache}
"""


@pytest.mark.parametrize("engine", ["auto", "redis", "redis-search", "redis-vsets", "local"])
def test_every_vector_search_choice_is_read(engine: str) -> None:
    parsed = parse_policy(policy(f"{{vector_search: {engine}}}"), file="p.yaml", environ={})
    assert parsed.tenants["t"].cache.vector_search == engine


def test_vector_search_hnsw_and_verifier_are_read() -> None:
    spec = (
        "{mode: semantic, vector_search: redis, hnsw: {m: 32, ef_runtime: 256}, "
        "verifier: {backend: vllm, model: reranker, threshold: 0.7, timeout: 500ms}}"
    )
    cache = parse_policy(policy(spec), file="p.yaml", environ={}).tenants["t"].cache
    assert cache.vector_search == "redis"
    assert cache.hnsw == HnswSpec(m=32, ef_construction=200, ef_runtime=256)
    assert cache.verifier is not None
    assert (cache.verifier.threshold, cache.verifier.min_similarity) == (0.7, 0.9)
    assert cache.verifier.timeout == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("{vector_search: faiss}", "vector_search"),
        ("{hnsw: {m: 1}}", "hnsw.m"),
        ("{hnsw: {ef: 10}}", "hnsw.ef"),
        ("{verifier: {backend: nowhere, model: reranker}}", "no backend named 'nowhere'"),
        ("{verifier: {backend: vllm, model: reranker, timeout: 0s}}", "verifier.timeout"),
    ],
)
def test_bad_cache_keys_are_named(spec: str, named: str) -> None:
    with pytest.raises(PolicyError) as caught:
        parse_policy(policy(spec), file="p.yaml", environ={})
    assert named in str(caught.value)
