"""Where question vectors come from: an OpenAI-compatible `/v1/embeddings` backend or a local model.

Every embedder returns unit-length float32 vectors and raises EmbedderUnavailable when it cannot;
the cache then steps aside and the request is served as if there were no cache.

numpy is imported by the first vector made (proxy/cache/vectors.py says why).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import httpx
import orjson

from proxy.policy.model import Backend

if TYPE_CHECKING:
    from proxy.cache.vectors import Vector

__all__ = ["BackendEmbedder", "Embedder", "EmbedderUnavailable", "normalise"]


class EmbedderUnavailable(Exception):
    """The embedder failed or timed out; the cache is skipped for this request."""


class Embedder(Protocol):
    @property
    def name(self) -> str:
        """Identifies the vector space: vectors of two embedders are never compared."""

    async def embed(self, text: str) -> Vector: ...

    async def aclose(self) -> None: ...


def normalise(question: str) -> str:
    """Case and spacing do not change a question's meaning (nor its cache partition's answer)."""
    return " ".join(question.split()).casefold()


class BackendEmbedder:
    """POSTs to `{backend}/embeddings` for `model`, over the backends that serve it in turn.

    `backends` is asked on every call: the policy serving now, so a reload that moves a backend
    (its url or key) moves the embedder with it."""

    def __init__(
        self, backends: Callable[[], Sequence[Backend]], model: str, *, timeout_s: float
    ) -> None:
        self._model = model
        self._backends = backends
        self._turn = 0
        self._client = httpx.AsyncClient(timeout=timeout_s, trust_env=False)

    @property
    def name(self) -> str:
        return f"model:{self._model}"

    async def embed(self, text: str) -> Vector:
        backends = self._backends()
        if not backends:  # a reload took the model from every backend
            raise EmbedderUnavailable(f"no backend serves {self._model!r}")
        backend = backends[self._turn % len(backends)]
        self._turn += 1
        headers = {"content-type": "application/json"}
        if backend.api_key is not None:
            headers["authorization"] = "Bearer " + backend.api_key.get_secret_value()
        body = orjson.dumps({"model": self._model, "input": text})
        try:
            response = await self._client.post(
                backend.url + "/embeddings", content=body, headers=headers
            )
        except httpx.HTTPError as exc:
            raise EmbedderUnavailable(f"{backend.name}: {type(exc).__name__}") from exc
        if response.status_code != 200:
            raise EmbedderUnavailable(f"{backend.name}: HTTP {response.status_code}")
        return _first_vector(response.content, backend.name)

    async def aclose(self) -> None:
        await self._client.aclose()


def _first_vector(raw: bytes, backend: str) -> Vector:
    import numpy as np

    try:
        values = orjson.loads(raw)["data"][0]["embedding"]
        vector = np.asarray(values, dtype=np.float32)
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as exc:
        raise EmbedderUnavailable(f"{backend}: not an embeddings answer") from exc
    norm = float(np.linalg.norm(vector))
    if vector.ndim != 1 or not norm:
        raise EmbedderUnavailable(f"{backend}: an empty or malformed vector")
    return vector / norm
