"""Where question vectors come from: an OpenAI-compatible `/v1/embeddings` backend or a local model.

Every embedder returns unit-length float32 vectors and raises EmbedderUnavailable when it cannot;
the cache then steps aside and the request is served as if there were no cache.

numpy is imported by the first vector made (proxy/cache/vectors.py says why).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import httpx
import orjson

from proxy.cache.reply import ReplyRefused, post_capped
from proxy.policy.model import Backend
from proxy.upstream.tls import backend_ssl_context

if TYPE_CHECKING:
    from proxy.cache.vectors import Vector

__all__ = [
    "MAX_DIMENSIONS",
    "BackendEmbedder",
    "Embedder",
    "EmbedderUnavailable",
    "QuestionUnseen",
    "normalise",
]

MAX_DIMENSIONS = 16_384
"""The largest embedding taken (the widest common models have 4,096; a stored vector's header
holds at most 65,535)."""
_ANSWER_BYTES = 4 * 1024 * 1024
"""An embeddings answer past this is refused: MAX_DIMENSIONS numbers take under 0.5 MB."""


class EmbedderUnavailable(Exception):
    """The embedder failed or timed out; the cache is skipped for this request."""


class QuestionUnseen(EmbedderUnavailable):
    """The embedder cannot see all of this question (a word it has no token for, or words past
    its length): two questions differing only there would get one vector, so the question is
    answered exactly only, not by meaning."""


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
        # trust_env=False keeps HTTP_PROXY out; the CAs are the requests' own (SSL_CERT_FILE).
        self._client = httpx.AsyncClient(
            timeout=timeout_s, trust_env=False, verify=backend_ssl_context()
        )

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
        url = backend.url + "/embeddings"
        try:
            raw = await post_capped(
                self._client, url, content=body, headers=headers, limit_bytes=_ANSWER_BYTES
            )
        except ReplyRefused as exc:
            raise EmbedderUnavailable(f"{backend.name}: {exc}") from exc
        return _first_vector(raw, backend.name)

    async def aclose(self) -> None:
        await self._client.aclose()


def _first_vector(raw: bytes, backend: str) -> Vector:
    """The answer's one embedding: an answer for more or fewer inputs than the one asked is
    refused, as is anything `_unit` refuses."""
    try:
        data = orjson.loads(raw)["data"]
        values = data[0]["embedding"] if isinstance(data, list) and len(data) == 1 else None
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise EmbedderUnavailable(f"{backend}: not an embeddings answer") from exc
    if values is None:
        raise EmbedderUnavailable(f"{backend}: not one embedding for the one input")
    return _unit(values, backend)


def _unit(values: object, backend: str) -> Vector:
    """`values` as a unit float32 vector: a list of 1 to MAX_DIMENSIONS JSON numbers (no
    strings, booleans or nested lists), finite, not all zero. Anything else would be stored as
    a vector no search can use (NaN), or could not be stored at all (too many dimensions)."""
    import numpy as np

    count = len(values) if isinstance(values, list) else 0
    if not 0 < count <= MAX_DIMENSIONS:
        raise EmbedderUnavailable(f"{backend}: an embedding of {count} dimensions")
    try:
        # No dtype asked: a string, a boolean or a nested list shows in the one numpy picks.
        vector = np.asarray(values)
    except ValueError as exc:  # a ragged nesting
        raise EmbedderUnavailable(f"{backend}: a malformed embedding") from exc
    if vector.ndim != 1 or vector.dtype.kind not in "iuf":
        raise EmbedderUnavailable(f"{backend}: an embedding that is not a list of numbers")
    with np.errstate(over="ignore", invalid="ignore"):
        wide = vector.astype(np.float64)
        norm = float(np.linalg.norm(wide))
    if not (math.isfinite(norm) and norm > 0.0):
        raise EmbedderUnavailable(f"{backend}: an embedding with a length of {norm}")
    result: Vector = (wide / norm).astype(np.float32)
    return result
