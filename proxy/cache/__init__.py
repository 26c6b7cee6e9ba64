"""The response cache: exact and semantic, isolated per tenant; see `proxy.stages.cache`."""

from __future__ import annotations

from collections.abc import Callable

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


def open_embedder(policy: Policy, serving: Callable[[], Policy] | None = None) -> Embedder | None:
    """The policy's `embedder:`; the local model is imported only when it is asked for. A
    backend embedder calls the backends of `serving()` (the policy after reloads), else of
    `policy`."""
    spec = policy.embedder
    if spec is None:
        return None
    if spec.model is not None:
        model, current = spec.model, serving or (lambda: policy)
        if not policy.backends_for(model):
            raise ValueError(f"no backend serves the embedding model {model!r}")
        return BackendEmbedder(lambda: current().backends_for(model), model, timeout_s=spec.timeout)
    from proxy.cache.embed_local import LocalEmbedder  # an optional extra: loaded on demand

    return LocalEmbedder()
