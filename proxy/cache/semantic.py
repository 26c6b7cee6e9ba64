"""Find an earlier question with the same meaning in the same partition, and check it may answer.

The vectors are searched by Redis itself (RediSearch's FT.SEARCH or Redis 8's vector sets: one
index that every replica shares) or by a mirror in this process (mirror.py), as
`cache.vector_search` and the server decide; candidates pass the guards and, with a
`cache.verifier`, a cross-encoder.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from proxy.cache.guards import compatible
from proxy.cache.verify import Reranker, VerifierUnavailable
from proxy.policy.model import CacheSpec
from proxy.storage.base import StorageError
from proxy.storage.cache import CacheStore, Graph, VectorEngine, VectorHit

if TYPE_CHECKING:
    from proxy.cache.vectors import Vector

__all__ = ["Match", "SemanticIndex"]

_log = logging.getLogger("tokenweir.cache")
_CANDIDATES = 4
_DEFAULT = CacheSpec()
# Which Redis engines each `cache.vector_search` may use; the store lists them in auto's order
# (RediSearch, then vector sets: storage/redis/cache.py).
_ENGINES: dict[str, tuple[str, ...]] = {
    "auto": ("search", "vsets"),
    "redis": ("search", "vsets"),
    "redis-search": ("search",),
    "redis-vsets": ("vsets",),
    "local": (),
}


@dataclass(frozen=True, slots=True)
class Match:
    key: str
    similarity: float


class SemanticIndex:
    """One per process; `verifier` answers the tenants whose cache spec has a `verifier:`."""

    def __init__(
        self, store: CacheStore, *, max_rows: int = 1_000_000, verifier: Reranker | None = None
    ) -> None:
        from proxy.cache.mirror import Mirrors  # and numpy, only where the semantic cache is on

        self._mirrors = Mirrors(store, max_rows=max_rows)
        self._engines = store.redis_engines()
        self._verifier = verifier
        self._used: set[VectorEngine] = set()
        self._warned: set[str] = set()

    async def graph(self, spec: CacheSpec) -> Graph | None:
        """The Redis engine new vectors go to, with its HNSW M and EF_CONSTRUCTION; None: to the
        mirrors."""
        engine = await self._engine(spec)
        if engine is None:
            return None
        return Graph(engine.name, spec.hnsw.m, spec.hnsw.ef_construction)

    async def nearest(
        self,
        tenant: str,
        partition: str,
        query: Vector,
        question: str,
        threshold: float,
        spec: CacheSpec = _DEFAULT,
    ) -> Match | None:
        """The most similar earlier question at or above `threshold` that passes the guards
        (and the verifier); None while a mirrored partition is still loading."""
        verifier = spec.verifier
        floor = threshold if verifier is None else min(threshold, verifier.min_similarity)
        engine = await self._engine(spec)
        if engine is not None:
            vector = query.astype("float32", copy=False).tobytes()
            ef = spec.hnsw.ef_runtime
            hits = await engine.nearest(tenant, partition, vector, count=_CANDIDATES, ef=ef)
        else:
            hits = await self._mirrors.nearest(tenant, partition, query, count=_CANDIDATES)
        passing = [h for h in hits if h.similarity >= floor and compatible(question, h.question)]
        if not passing:
            return None
        if verifier is None:
            return Match(passing[0].key, passing[0].similarity)
        return await self._verified(spec, question, passing)

    def forget(self, tenant: str, partition: str, key: str) -> None:
        """Stop offering `key` (its answer is gone from the store)."""
        self._mirrors.forget(tenant, partition, key)
        for engine in self._used:
            engine.remove(tenant, partition, key)

    async def aclose(self) -> None:
        try:
            await self._mirrors.aclose()
        finally:
            if self._verifier is not None:
                await self._verifier.aclose()

    async def _engine(self, spec: CacheSpec) -> VectorEngine | None:
        """The first engine `spec.vector_search` allows that the server has; None: the mirror."""
        allowed = _ENGINES[spec.vector_search]
        for engine in self._engines:
            if engine.name not in allowed:
                continue
            try:
                if await engine.available():
                    self._used.add(engine)
                    return engine
            except StorageError as exc:
                _log.warning("could not ask Redis for its vector search: %s", exc)
                return None
        if spec.vector_search not in ("auto", "local") and spec.vector_search not in self._warned:
            self._warned.add(spec.vector_search)
            _log.warning(
                "cache.vector_search is %s but the server has no such vector search (RediSearch "
                "or Redis 8's vector sets): the in-process mirror is used",
                spec.vector_search,
            )
        return None

    async def _verified(
        self, spec: CacheSpec, question: str, candidates: list[VectorHit]
    ) -> Match | None:
        if self._verifier is None or spec.verifier is None:
            return None
        documents = [hit.question for hit in candidates]
        try:
            scores = await self._verifier.scores(spec.verifier, question, documents)
        except VerifierUnavailable as exc:
            _log.warning("cache verifier unavailable, counted as a miss: %s", exc)
            return None
        score, best = max(zip(scores, candidates, strict=True), key=lambda pair: pair[0])
        if score < spec.verifier.threshold:
            return None
        return Match(best.key, best.similarity)
