"""The response cache: exact and semantic, isolated per tenant; see `proxy.stages.cache`."""

from __future__ import annotations

from proxy.cache.answer import Answer
from proxy.cache.embed import BackendEmbedder, Embedder, EmbedderUnavailable
from proxy.cache.key import CacheKey, cache_key
from proxy.cache.semantic import Match, SemanticIndex
from proxy.policy.model import Policy

__all__ = [
    "Answer",
    "BackendEmbedder",
    "CacheKey",
    "Embedder",
    "EmbedderUnavailable",
    "Match",
    "SemanticIndex",
    "cache_key",
    "open_embedder",
]


def open_embedder(policy: Policy) -> Embedder | None:
    """The policy's `embedder:`; the local model is imported only when it is asked for."""
    spec = policy.embedder
    if spec is None:
        return None
    if spec.model is not None:
        backends = policy.backends_for(spec.model)
        return BackendEmbedder(backends, spec.model, timeout_s=spec.timeout)
    from proxy.cache.embed_local import LocalEmbedder  # an optional extra: loaded on demand

    return LocalEmbedder()
