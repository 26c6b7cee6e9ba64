"""The mock backend's `/v1/rerank` (the Cohere/Jina shape vLLM serves): deterministic scores.

A document's relevance is the overlap of its words with the query's (Jaccard, case-sensitive):
1 for the same words, 0 for none in common; answered after the mock's TTFT, as a model would.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from proxy.tools.mock.request import MockHTTPError

__all__ = ["rerank_answer"]

_WORD = re.compile(r"\w+")


def rerank_answer(body: dict[str, Any]) -> bytes:
    query, documents = body.get("query"), body.get("documents")
    if not isinstance(query, str) or not isinstance(documents, list) or not documents:
        raise MockHTTPError(400, "rerank needs a query string and a list of documents")
    texts = [d.get("text") if isinstance(d, dict) else d for d in documents]
    if not all(isinstance(text, str) for text in texts):
        raise MockHTTPError(
            400, "each document must be a string or {text: string}", param="documents"
        )
    words = _words(query)
    results = [
        {"index": index, "relevance_score": _overlap(words, _words(str(text)))}
        for index, text in enumerate(texts)
    ]
    results.sort(key=lambda result: -float(result["relevance_score"]))
    top_n = body.get("top_n")
    if isinstance(top_n, int) and top_n > 0:
        results = results[:top_n]
    usage = {"total_tokens": sum(len(str(text).split()) for text in texts) + len(query.split())}
    return orjson.dumps({"model": body.get("model"), "results": results, "usage": usage})


def _words(text: str) -> set[str]:
    return set(_WORD.findall(text))


def _overlap(one: set[str], two: set[str]) -> float:
    union = one | two
    return len(one & two) / len(union) if union else 1.0
