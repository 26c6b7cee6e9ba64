"""The mock backend's /v1/rerank: deterministic word-overlap scores in the Cohere/Jina shape."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from proxy.tools.mock import backend as mockbackend
from tests.servers import serve


@pytest.fixture(scope="module")
def mock() -> Iterator[httpx.Client]:
    with serve(mockbackend.create_app(ttft_ms=0)) as url, httpx.Client(base_url=url) as client:
        yield client


def test_documents_are_ranked_by_word_overlap(mock: httpx.Client) -> None:
    body = {
        "model": "any-reranker",
        "query": "what is the capital of France",
        "documents": ["cheap hotels in Rome", {"text": "what is the capital of France"}, "France"],
    }
    answer = mock.post("/v1/rerank", json=body)
    assert answer.status_code == 200
    results = answer.json()["results"]
    assert [r["index"] for r in results] == [1, 2, 0]
    assert [r["relevance_score"] for r in results] == [1.0, pytest.approx(1 / 6), 0.0]
    assert mock.post("/v1/rerank", json=body).json() == answer.json()  # deterministic
    top = mock.post("/v1/rerank", json=body | {"top_n": 1}).json()["results"]
    assert [r["index"] for r in top] == [1]


@pytest.mark.parametrize(
    "body", [{"query": "q"}, {"query": "q", "documents": []}, {"query": 1, "documents": ["d"]}]
)
def test_a_malformed_rerank_request_is_a_400(mock: httpx.Client, body: dict[str, object]) -> None:
    answer = mock.post("/v1/rerank", json=body)
    assert answer.status_code == 400
    assert answer.json()["error"]["message"]
