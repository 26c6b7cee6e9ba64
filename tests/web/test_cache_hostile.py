"""The semantic cache against a hostile embedder and verifier (a Starlette server on 127.0.0.1
answering `/v1/embeddings` and `/v1/rerank` with whatever a test sets): no answer of theirs may
break a request, leak its hold on the tenant's limits, store a vector the cache cannot use, or
turn a candidate into a hit the verifier did not give. Nor may a tenant's own long questions
stall the guards that compare them."""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import httpx
import orjson
import pytest
import redis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from proxy.app import create_app
from proxy.policy import Policy, parse_policy
from proxy.policy.units import hash_key
from tests.redis8 import redis8_server, redis8_url
from tests.servers import serve

__all__ = ["redis8_server", "redis8_url"]  # fixtures

KEY = "tw-test-hostile-embedder"
UNIT = [1.0, 0.0, 0.0, 0.0]


class Hostile:
    """What the next embeddings and rerank answers are: a vector (sent as OpenAI's list of one),
    `"random"` (a new one each time), raw bytes, or `endless` (whitespace, a MiB at a time, for
    ever)."""

    def __init__(self) -> None:
        self.embedding: Any = UNIT
        self.rerank: bytes = b'{"results": [{"index": 0, "relevance_score": 0.0}]}'
        self.endless: set[str] = set()
        self.sent_bytes = 0  # of endless answers, as the gateway read them
        self._random = random.Random(7)  # noqa: S311 (test vectors, not secrets)

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/embeddings", self._embeddings, methods=["POST"]),
                Route("/v1/rerank", self._rerank, methods=["POST"]),
            ]
        )

    async def _embeddings(self, request: Request) -> Response:
        await request.body()
        if "embeddings" in self.endless:
            return StreamingResponse(self._whitespace(request), media_type="application/json")
        raw = self.embedding
        if raw == "random":  # 384 dimensions: two are as good as never similar
            raw = [self._random.gauss(0.0, 1.0) for _ in range(384)]
        if not isinstance(raw, bytes):
            raw = orjson.dumps({"object": "list", "data": [{"index": 0, "embedding": raw}]})
        return Response(raw, media_type="application/json")

    async def _rerank(self, request: Request) -> Response:
        await request.body()
        if "rerank" in self.endless:
            return StreamingResponse(self._whitespace(request), media_type="application/json")
        return Response(self.rerank, media_type="application/json")

    async def _whitespace(self, request: Request) -> AsyncIterator[bytes]:
        """A MiB of whitespace at a time until the gateway hangs up, counting what it took."""
        chunk = b" " * (1 << 20)
        while not await request.is_disconnected():
            yield chunk
            self.sent_bytes += len(chunk)


def policy(backend_url: str, hostile_url: str, cache: str, storage: str) -> Policy:
    """One tenant allowed one request at a time: a hold never given back shows as a 429."""
    text = f"""
storage: {storage}
embedder: {{model: evil-embed, timeout: 2s}}
backends:
  - {{name: mock-a, url: {backend_url}/v1, models: [mock-llm]}}
  - {{name: evil, url: {hostile_url}/v1, models: [evil-embed]}}
models:
  mock-llm: {{}}
  evil-embed: {{}}
tenants:
  alpha:
    api_keys: [{hash_key(KEY)}]
    models: [mock-llm]
    limits: {{max_concurrent: 1}}
    cache: {cache}
"""
    return parse_policy(text, file="hostile.yaml", environ={})


@pytest.fixture
def hostile() -> Hostile:
    return Hostile()


@pytest.fixture
def hostile_url(hostile: Hostile) -> Iterator[str]:
    with serve(hostile.app()) as url:
        yield url


def gateway(
    backend_url: str, hostile_url: str, cache: str = "{mode: semantic}", storage: str = "memory"
) -> Any:
    return serve(create_app(policy(backend_url, hostile_url, cache, storage)))


def ask(url: str, question: str) -> httpx.Response:
    payload = {
        "model": "mock-llm",
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
    }
    auth = {"authorization": f"Bearer {KEY}"}
    return httpx.post(url + "/v1/chat/completions", json=payload, headers=auth, timeout=30)


def answered(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    content: str = response.json()["choices"][0]["message"]["content"]
    assert content
    return response.headers["x-tokenweir-cache"]


def stored_vectors(redis_url: str) -> int:
    """Vectors in the streams the in-process mirrors read (a Redis without vector search)."""
    with redis.Redis.from_url(redis_url) as admin:
        return sum(int(admin.xlen(key)) for key in admin.scan_iter(match="tw:*:cache:v:*"))


@pytest.mark.parametrize(
    "embedding",
    [
        pytest.param([1.0] + [0.0] * 70_000, id="70001-dimensions"),
        pytest.param(["NaN", 1.0, 0.0, 0.0], id="nan"),
        pytest.param([True, False, False, False], id="booleans"),
        pytest.param(["1", "0", "0", "0"], id="strings"),
        pytest.param(
            orjson.dumps({"data": [{"embedding": UNIT}, {"embedding": UNIT}]}), id="two-for-one"
        ),
    ],
)
def test_an_embedding_the_cache_cannot_use_is_no_vector_and_breaks_nothing(
    backend_url: str, hostile: Hostile, hostile_url: str, redis_url: str, embedding: Any
) -> None:
    hostile.embedding = embedding
    with gateway(backend_url, hostile_url, storage=redis_url) as url:
        first = ask(url, "What is the capital of France?")
        again = ask(url, "What is the capital of France?")
    assert answered(first) == "miss"
    assert answered(again) == "hit"  # the exact cache still works, and the first gave back its hold
    assert stored_vectors(redis_url) == 0


def test_an_embedder_whose_dimension_changes_breaks_no_request(
    backend_url: str, hostile: Hostile, hostile_url: str, redis_url: str
) -> None:
    """The in-process mirror's search (here on a Redis without vector search): a question of
    another dimension than the partition's vectors is a miss, and a partition whose stream
    holds both (two replicas, each with an embedder of its own mind) still serves the first."""
    spec = "{mode: semantic, similarity: 0.9}"
    with gateway(backend_url, hostile_url, spec, redis_url) as url:
        assert answered(ask(url, "What is the capital of France?")) == "miss"
        hostile.embedding = [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
        wider = ask(url, "Where is the Louvre?")
        again = ask(url, "Where is the Louvre?")
    assert answered(wider) == "miss"
    assert answered(again) == "hit"
    assert stored_vectors(redis_url) == 2  # both in the partition's stream
    hostile.embedding = UNIT
    with gateway(backend_url, hostile_url, spec, redis_url) as url:  # a fresh mirror reads both
        reworded = ask(url, "what is the capital of france")
    assert answered(reworded) == "semantic-hit"


VERIFIED = "{mode: semantic, similarity: 0.9, verifier: {backend: evil, model: r, threshold: 0.5}}"


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        pytest.param('{"index": 0, "relevance_score": 0.99}', "semantic-hit", id="a-real-yes"),
        pytest.param('{"index": 0, "relevance_score": 0.1}', "miss", id="a-real-no"),
        pytest.param('{"index": 0, "relevance_score": "NaN"}', "miss", id="nan"),
        pytest.param('{"index": 0, "relevance_score": "0.99"}', "miss", id="a-string"),
        pytest.param('{"index": 0, "relevance_score": true}', "miss", id="true"),
        pytest.param('{"index": -1, "relevance_score": 0.99}', "miss", id="index-minus-one"),
        pytest.param('{"index": 0.0, "relevance_score": 0.99}', "miss", id="index-a-float"),
    ],
)
def test_only_a_verifiers_finite_score_for_a_candidate_makes_a_hit(
    backend_url: str, hostile: Hostile, hostile_url: str, result: str, expected: str
) -> None:
    hostile.rerank = b'{"results": [%s]}' % result.encode()
    with gateway(backend_url, hostile_url, VERIFIED) as url:
        assert answered(ask(url, "What is the capital of France?")) == "miss"
        reworded = ask(url, "what is the capital of france")  # the same vector: a candidate
    assert answered(reworded) == expected


@pytest.mark.parametrize("service", ["embeddings", "rerank"])
def test_an_endless_answer_from_the_embedder_or_verifier_is_read_only_so_far(
    backend_url: str, hostile: Hostile, hostile_url: str, service: str
) -> None:
    """Read until its deadline (2 s, 1 s), the endless answer took hundreds of MB of the
    gateway's memory, for each request at once; now reading stops at a few MB."""
    with gateway(backend_url, hostile_url, VERIFIED) as url:
        assert answered(ask(url, "What is the capital of France?")) == "miss"
        hostile.endless.add(service)
        reworded = ask(url, "what is the capital of france")
    assert answered(reworded) == "miss"
    assert hostile.sent_bytes < 64 * 1024 * 1024


def test_two_long_questions_full_of_names_are_compared_in_linear_time(
    backend_url: str, hostile_url: str
) -> None:
    """A tenant's own two questions, close to its embedder (the local model reads only their
    first 256 tokens): the guards that compare them looked for each of one's 40,000 names in
    the whole of the other, 7.6 s of the event loop that every tenant waits on."""
    names = " ".join(f"Name{i:06d}x" for i in range(40_000))
    others = " ".join(f"other{i:06d}y" for i in range(40_000))
    spec = "{mode: semantic, similarity: 0.9, max_entry_bytes: 1MiB}"  # questions this long
    with gateway(backend_url, hostile_url, spec) as url:
        assert answered(ask(url, "Tell me about " + names)) == "miss"
        started = time.monotonic()
        second = ask(url, "Tell me about " + others)
        elapsed_s = time.monotonic() - started
    assert answered(second) == "semantic-hit"
    assert elapsed_s < 5.0  # the old code took 7.9 s here, unloaded


def wait_for_keys(url: str, pattern: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    with redis.Redis.from_url(url) as admin:
        while not any(admin.scan_iter(match=pattern)):
            assert time.monotonic() < deadline, f"no {pattern} within {timeout_s} s"
            time.sleep(0.05)


def test_a_vector_set_of_another_dimension_is_a_miss_not_a_storage_failure(
    backend_url: str, hostile: Hostile, hostile_url: str, redis8_url: str
) -> None:
    """Redis 8's vector sets refuse a question of another dimension than the partition's set:
    the lookup counted that as the cache storage failing, so the exact cache was skipped too
    and nothing was stored until the set expired."""
    spec = "{mode: semantic, similarity: 0.9, vector_search: redis-vsets}"
    with gateway(backend_url, hostile_url, spec, redis8_url) as url:
        assert answered(ask(url, "What is the capital of France?")) == "miss"
        wait_for_keys(redis8_url, "tw:*:cache:s:*")  # the vector is written in the background
        hostile.embedding = [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
        wider = ask(url, "Where is the Louvre?")
        again = ask(url, "Where is the Louvre?")
    assert answered(wider) == "miss"
    assert answered(again) == "hit"


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


def test_an_embedder_of_ever_new_dimensions_makes_a_tenant_few_redis_search_indexes(
    backend_url: str, hostile: Hostile, hostile_url: str, redis8_url: str
) -> None:
    """RediSearch keeps an index per tenant and dimension, and each index takes in every vector
    hash of the tenant: an embedder answering another dimension each time made an index each
    time, and at 1,000 of them each hash write took 5.7 ms of Redis (68 µs with one)."""
    spec = "{mode: semantic, similarity: 0.9, vector_search: redis-search}"
    with gateway(backend_url, hostile_url, spec, redis8_url) as url:
        for dim in range(4, 14):
            hostile.embedding = [1.0] * dim
            assert answered(ask(url, f"Question number {dim}?")) == "miss"
        hostile.embedding = UNIT
        assert answered(ask(url, "What is the capital of France?")) == "miss"
        deadline = time.monotonic() + 10.0  # its vector is written after the others'
        while answered(ask(url, "what is the capital of france")) != "semantic-hit":
            assert time.monotonic() < deadline, "the first dimension's index no longer hits"
            time.sleep(0.05)
    with redis.Redis.from_url(redis8_url) as admin:
        indexes = [name for name in admin.execute_command("FT._LIST") if b"{alpha}" in name]
    assert 1 <= len(indexes) <= 4, indexes


def test_many_conversations_each_cost_the_mirror_about_their_vectors(
    backend_url: str, hostile: Hostile, hostile_url: str
) -> None:
    """Each conversation context is a partition of its own, mirrored in this process once it is
    searched with a vector stored: its first vector made room for 64 (96 KiB at MiniLM's 384
    dimensions), so a tenant's 3,000 conversations of two questions took 106 MiB of the
    gateway's memory, under a bound (`max_rows`, a million) that counts rows."""
    hostile.embedding = [1.0] + [0.0] * 383
    with gateway(backend_url, hostile_url) as url:
        questions = ("What is the capital of France?", "Which city is France's capital?")
        bodies = (_in_conversation(n, q) for n in range(3_000) for q in questions)
        grown_mib = _rss_growth_mib(url, bodies)
    assert grown_mib < 60  # 25 MiB here; the old code: 105


def test_a_question_longer_than_an_entry_may_be_is_cached_exactly_only(
    backend_url: str, hostile: Hostile, hostile_url: str, redis_url: str
) -> None:
    """A semantic entry keeps its question beside its vector (the guards compare questions):
    a 1 MB question was kept whole, four times the entry's `max_entry_bytes`, in Redis and in
    every gateway's mirror of its partition."""
    spec = "{mode: semantic, similarity: 0.9, max_entry_bytes: 256KiB}"
    long_question = "Tell me about " + "history " * 125_000
    with gateway(backend_url, hostile_url, spec, redis_url) as url:
        first = ask(url, long_question)
        again = ask(url, long_question)
        hostile.embedding = [0.0, 1.0, 0.0, 0.0]
        assert answered(ask(url, "What is the capital of France?")) == "miss"
    assert (answered(first), answered(again)) == ("miss", "hit")
    assert stored_vectors(redis_url) == 1  # the short question's alone


def test_conversations_whose_entries_are_gone_leave_nothing_in_memory_storage(
    backend_url: str, hostile_url: str
) -> None:
    """`storage: memory` kept each partition's vectors, questions in them, after the last of its
    entries was evicted: with `max_entries: 10`, 600 conversations of a 150 KB question held
    about 100 MiB; every new conversation added to it for as long as the gateway ran."""
    spec = "{mode: semantic, similarity: 0.9, max_entries: 10}"
    question = "Tell me about " + "history " * 19_000
    with gateway(backend_url, hostile_url, spec) as url:
        grown_mib = _rss_growth_mib(url, (_in_conversation(n, question) for n in range(600)))
    assert grown_mib < 60  # 23 MiB here; the old code: 99


def test_one_conversations_mirror_does_not_keep_every_question_it_ever_stored(
    backend_url: str, hostile: Hostile, hostile_url: str
) -> None:
    """One context (a chatbot's system prompt: the common case), many different questions, under
    `max_entries: 10`: the mirror kept the vector and question of every answer ever stored,
    evicted or not, for as long as the gateway ran (1,500 questions of 64 KB: about 100 MiB)."""
    hostile.embedding = "random"
    spec = "{mode: semantic, similarity: 0.9, max_entries: 10}"
    filler = "history " * 8_000
    with gateway(backend_url, hostile_url, spec) as url:
        questions = (f"Question {n}: {filler}" for n in range(1_500))
        grown_mib = _rss_growth_mib(url, (_asked_alone(q) for q in questions), cache="miss")
    assert grown_mib < 60  # 29 MiB here; the old code: 95


def _in_conversation(n: int, question: str) -> dict[str, Any]:
    """`question` in conversation `n` (its own system prompt: its own semantic partition)."""
    messages = [
        {"role": "system", "content": f"Conversation {n}."},
        {"role": "user", "content": question},
    ]
    return {"model": "mock-llm", "messages": messages, "temperature": 0, "max_tokens": 1}


def _asked_alone(question: str) -> dict[str, Any]:
    messages = [{"role": "user", "content": question}]
    return {"model": "mock-llm", "messages": messages, "temperature": 0, "max_tokens": 1}


def _rss_growth_mib(url: str, bodies: Iterable[dict[str, Any]], cache: str | None = None) -> float:
    """How much the gateway's memory grew while it answered `bodies` (after one warm-up
    request), each answered 200 (and `cache`, if given, in its x-tokenweir-cache)."""
    assert answered(ask(url, "Warm up.")) == "miss"
    before = rss_mib()
    auth = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=url, headers=auth, timeout=30) as client:
        for body in bodies:
            answer = client.post("/v1/chat/completions", json=body)
            assert answer.status_code == 200
            if cache is not None:
                assert answer.headers["x-tokenweir-cache"] == cache
    return rss_mib() - before
