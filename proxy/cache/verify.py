"""The semantic cache's optional verifier: a cross-encoder behind a backend's `/rerank` route.

The request is the Cohere/Jina shape vLLM serves: `{model, query, documents}`, answered with
`results: [{index, relevance_score}]`. Any failure or a late answer raises VerifierUnavailable.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import anyio
import httpx
import orjson

from proxy.cache.reply import ReplyRefused, post_capped
from proxy.policy.model import Backend, VerifierSpec
from proxy.upstream.tls import backend_ssl_context

__all__ = ["Reranker", "VerifierUnavailable"]

_ANSWER_BYTES = 1024 * 1024
"""A rerank answer past this (and past what its documents take) is refused."""


class VerifierUnavailable(Exception):
    """The verifier failed or did not answer in time: the candidate does not count as a hit."""


class Reranker:
    """Its HTTP client is opened on the first verification: most policies have no verifier.
    `backends` is asked on every call (the policy serving now: a reload may move a backend)."""

    def __init__(self, backends: Callable[[], Sequence[Backend]]) -> None:
        self._backends = backends
        self._client: httpx.AsyncClient | None = None

    async def scores(self, spec: VerifierSpec, query: str, documents: list[str]) -> list[float]:
        """Each document's relevance to `query`, in the documents' order."""
        backend = next((b for b in self._backends() if b.name == spec.backend), None)
        if backend is None:
            raise VerifierUnavailable(f"no backend named {spec.backend!r}")
        headers = {"content-type": "application/json"}
        if backend.api_key is not None:
            headers["authorization"] = "Bearer " + backend.api_key.get_secret_value()
        body = orjson.dumps({"model": spec.model, "query": query, "documents": documents})
        if self._client is None:
            self._client = httpx.AsyncClient(trust_env=False, verify=backend_ssl_context())
        # Rerankers may send the documents back (vLLM does), escaped as JSON may escape them.
        limit = _ANSWER_BYTES + 8 * len(body)
        try:
            with anyio.fail_after(spec.timeout):
                raw = await post_capped(
                    self._client, backend.url + "/rerank", content=body, headers=headers,
                    limit_bytes=limit, timeout_s=spec.timeout,
                )  # fmt: skip
        except TimeoutError as exc:
            raise VerifierUnavailable(f"{backend.name}: TimeoutError") from exc
        except ReplyRefused as exc:
            raise VerifierUnavailable(f"{backend.name}: {exc}") from exc
        return _scores(raw, len(documents), backend.name)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


def _scores(raw: bytes, count: int, backend: str) -> list[float]:
    """Each document's score (0 where the answer gives none). An index must be a JSON integer
    naming one of the documents and a score a finite JSON number: `"NaN"` once passed every
    threshold (`score < threshold` is false for NaN), `-1` scored the last document, `"0.99"` and
    `true` were taken as numbers."""
    try:
        results = orjson.loads(raw)["results"]
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise VerifierUnavailable(f"{backend}: not a rerank answer") from exc
    if not isinstance(results, list):
        raise VerifierUnavailable(f"{backend}: not a rerank answer")
    scores = [0.0] * count
    for result in results:
        index, score = _scored(result)
        if index is None or not 0 <= index < count or score is None:
            raise VerifierUnavailable(f"{backend}: a rerank result that is not a score")
        scores[index] = score
    return scores


def _scored(result: object) -> tuple[int | None, float | None]:
    if not isinstance(result, dict):
        return None, None
    index, score = result.get("index"), result.get("relevance_score")
    finite = None
    if isinstance(score, int | float) and not isinstance(score, bool) and math.isfinite(score):
        finite = float(score)
    return (index if type(index) is int else None), finite
