"""The response cache end to end: real gateway, real backend, the openai SDK, memory and Redis."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from proxy.app import create_app
from proxy.clock import FakeClock
from proxy.ledger import open_ledger
from proxy.policy import Policy, parse_policy
from proxy.policy.units import hash_key
from tests.conftest import ALPHA_KEY
from tests.servers import free_port, serve

COLLIDE_A_KEY = "tw-test-collide-a"
COLLIDE_AB_KEY = "tw-test-collide-ab"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def cache_policy(
    backend_url: str, storage: str, cache: str, *, embedder: str = "", ledger: str = ""
) -> Policy:
    """alpha, `a` and `a:b` (names built to collide) with one cache spec; a dead embedder too."""
    dead = f"http://127.0.0.1:{free_port()}/v1"
    text = f"""
storage: {storage}
{embedder}
{ledger}
backends:
  - {{name: mock-a, url: {backend_url}/v1, models: [mock-llm, mock-embed]}}
  - {{name: dead, url: {dead}, models: [dead-embed]}}
models:
  mock-llm: {{price: {{input_per_1m: 100, output_per_1m: 400}}}}
  mock-embed: {{}}
  dead-embed: {{}}
tenants:
  alpha: {{api_keys: [{hash_key(ALPHA_KEY)}], models: [mock-llm], cache: {cache}}}
  a: {{api_keys: [{hash_key(COLLIDE_A_KEY)}], models: [mock-llm], cache: {cache}}}
  "a:b": {{api_keys: [{hash_key(COLLIDE_AB_KEY)}], models: [mock-llm], cache: {cache}}}
"""
    return parse_policy(text, file="cache.yaml", environ={})


def gateway(
    backend_url: str,
    storage: str = "memory",
    cache: str = "{mode: exact}",
    *,
    clock: FakeClock | None = None,
    **more: str,
) -> Any:
    return serve(create_app(cache_policy(backend_url, storage, cache, **more), clock=clock))


@pytest.fixture(params=["memory", "redis"])
def storage(request: pytest.FixtureRequest) -> str:
    return "memory" if request.param == "memory" else str(request.getfixturevalue("redis_url"))


def sdk(url: str, key: str = ALPHA_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def ask(url: str, key: str = ALPHA_KEY, **body: Any) -> httpx.Response:
    payload = {"model": "mock-llm", "messages": QUESTION, "temperature": 0, **body}
    auth = {"authorization": f"Bearer {key}"}
    return httpx.post(url + "/v1/chat/completions", json=payload, headers=auth, timeout=10)


def backend_requests(backend: httpx.Client) -> int:
    return int(backend.get("/mock/stats").json()["requests_total"])


@pytest.fixture
def cached_url(backend_url: str, storage: str) -> Iterator[str]:
    with gateway(backend_url, storage) as url:
        yield url


def test_a_repeat_is_answered_from_the_cache(cached_url: str, backend: httpx.Client) -> None:
    first, second = ask(cached_url), ask(cached_url)
    assert (first.headers["x-tokenweir-cache"], second.headers["x-tokenweir-cache"]) == (
        "miss",
        "hit",
    )
    assert backend_requests(backend) == 1
    one, two = first.json(), second.json()
    assert two["choices"] == one["choices"]
    assert two["usage"] == one["usage"]
    assert two["id"] != one["id"]


def test_stream_replay_equals_the_original_through_the_sdk(
    cached_url: str, backend: httpx.Client
) -> None:
    with sdk(cached_url) as client:
        runs = []
        for _ in range(2):
            chunks = list(
                client.chat.completions.create(
                    model="mock-llm",
                    messages=QUESTION,  # type: ignore[arg-type]
                    temperature=0,
                    max_tokens=300,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            runs.append((text, finish, chunks[-1].usage))
    assert backend_requests(backend) == 1
    assert runs[0] == runs[1]
    usage = runs[1][2]
    assert usage is not None
    assert len(runs[1][0].split()) == usage.completion_tokens > 100


def test_a_whole_answer_is_replayed_as_a_stream_and_back(cached_url: str) -> None:
    whole = ask(cached_url).json()
    with sdk(cached_url) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="mock-llm",
            messages=QUESTION,  # type: ignore[arg-type]
            temperature=0,
            stream=True,
        )
        assert raw.headers["x-tokenweir-cache"] == "hit"
        chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole["choices"][0]["message"]["content"]
    assert all(c.usage is None for c in chunks)  # the client did not ask for usage


def test_identical_prompts_of_two_tenants_never_share_answers(
    cached_url: str, backend: httpx.Client
) -> None:
    answers = [ask(cached_url, key) for key in (COLLIDE_A_KEY, COLLIDE_AB_KEY, ALPHA_KEY)]
    assert [a.headers["x-tokenweir-cache"] for a in answers] == ["miss"] * 3
    assert backend_requests(backend) == 3
    assert ask(cached_url, COLLIDE_AB_KEY).headers["x-tokenweir-cache"] == "hit"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"temperature": 0.7}, "bypass"),
        ({"temperature": 0.7, "seed": 42}, "miss"),
        ({"temperature": None}, "bypass"),  # omitted temperature means 1
        ({"n": 2}, "bypass"),
    ],
)
def test_only_deterministic_requests_are_cached_by_default(
    cached_url: str, body: dict[str, Any], expected: str
) -> None:
    payload = {"model": "mock-llm", "messages": QUESTION}
    payload |= {k: v for k, v in body.items() if v is not None}
    auth = {"authorization": f"Bearer {ALPHA_KEY}"}
    answer = httpx.post(cached_url + "/v1/chat/completions", json=payload, headers=auth)
    assert answer.headers["x-tokenweir-cache"] == expected


def test_mode_always_caches_sampled_requests(backend_url: str, backend: httpx.Client) -> None:
    with gateway(backend_url, cache="{mode: always}") as url:
        first, second = ask(url, temperature=0.9), ask(url, temperature=0.9)
    assert second.headers["x-tokenweir-cache"] == "hit"
    assert second.json()["choices"] == first.json()["choices"]


def test_the_client_can_bypass_the_cache(cached_url: str, backend: httpx.Client) -> None:
    ask(cached_url)
    bypassed = httpx.post(
        cached_url + "/v1/chat/completions",
        json={"model": "mock-llm", "messages": QUESTION, "temperature": 0},
        headers={"authorization": f"Bearer {ALPHA_KEY}", "x-tokenweir-cache": "bypass"},
    )
    assert bypassed.headers["x-tokenweir-cache"] == "bypass"
    assert backend_requests(backend) == 2


def test_entries_expire_after_their_ttl(backend_url: str, storage: str) -> None:
    clock = FakeClock()
    with gateway(backend_url, storage, "{mode: exact, ttl: 10m}", clock=clock) as url:
        ask(url)
        clock.advance(599)
        assert ask(url).headers["x-tokenweir-cache"] == "hit"
        clock.advance(2)
        assert ask(url).headers["x-tokenweir-cache"] == "miss"


def test_least_recently_used_entries_are_evicted(backend_url: str, storage: str) -> None:
    with gateway(backend_url, storage, "{mode: exact, max_entries: 2}") as url:
        for question in ("one", "two", "three"):
            ask(url, messages=[{"role": "user", "content": question}])
        statuses = [
            ask(url, messages=[{"role": "user", "content": q}]).headers["x-tokenweir-cache"]
            for q in ("three", "two", "one")
        ]
    assert statuses == ["hit", "hit", "miss"]


def test_a_lowered_max_entries_does_not_hold_redis_for_every_tenant(
    backend_url: str, redis_url: str
) -> None:
    """A tenant holding more answers than its `max_entries` (a reload or a new replica lowered
    it) had the whole excess evicted by the script storing its next answer: Redis runs one
    script at a time, and 100,000 evictions held it, so every tenant's limits, budgets and cache,
    for about half a second (the store's own call gave up after its 1 s timeout)."""
    old = 100_000
    with redis.Redis.from_url(redis_url) as admin:
        last_use = int(time.time()) - 10
        with admin.pipeline(transaction=False) as fill:
            for i in range(old):
                fill.set(f"tw:{{alpha}}:cache:x:old{i}", b"answer", px=3_600_000)
            fill.zadd("tw:{alpha}:cache:lru", {f"old{i}": last_use for i in range(old)})
            fill.execute()
        slower_than = admin.config_get("slowlog-log-slower-than")["slowlog-log-slower-than"]
        admin.config_set("slowlog-log-slower-than", 100_000)  # µs
        admin.slowlog_reset()
        try:
            with gateway(backend_url, redis_url, "{mode: exact, max_entries: 10}") as url:
                first, again = ask(url), ask(url)
            held = admin.slowlog_get(10)
        finally:
            admin.config_set("slowlog-log-slower-than", slower_than)
        left = int(admin.zcard("tw:{alpha}:cache:lru"))
    assert (first.headers["x-tokenweir-cache"], again.headers["x-tokenweir-cache"]) == (
        "miss",
        "hit",
    )
    assert held == []  # no command of 100 ms or more
    assert left < old  # the excess goes, a few dozen at each answer stored


def test_a_stream_the_client_left_is_never_cached(cached_url: str, backend: httpx.Client) -> None:
    body = {
        "model": "mock-llm",
        "messages": QUESTION,
        "temperature": 0,
        "stream": True,
        "max_tokens": 5000,
    }
    auth = {"authorization": f"Bearer {ALPHA_KEY}"}
    with httpx.Client(base_url=cached_url, timeout=10) as http:
        with http.stream("POST", "/v1/chat/completions", json=body, headers=auth) as answer:
            lines = answer.iter_lines()
            for _ in range(10):
                next(lines)
            answer.close()
    again = ask(cached_url, stream=True, max_tokens=5000)
    assert again.headers["x-tokenweir-cache"] == "miss"


def test_a_stream_the_backend_broke_is_never_cached(cached_url: str) -> None:
    broken = ask(cached_url, stream=True, mock_fail_after_tokens=5)
    assert b"[DONE]" not in broken.content
    assert ask(cached_url, stream=True, mock_fail_after_tokens=5).headers["x-tokenweir-cache"] == (
        "miss"
    )


def test_an_oversized_answer_is_not_kept(backend_url: str) -> None:
    with gateway(backend_url, cache="{mode: exact, max_entry_bytes: 1KiB}") as url:
        ask(url, max_tokens=2000)
        assert ask(url, max_tokens=2000).headers["x-tokenweir-cache"] == "miss"
        ask(url, max_tokens=5)
        assert ask(url, max_tokens=5).headers["x-tokenweir-cache"] == "hit"


EMBED = "embedder: {model: mock-embed, timeout: 2s}"


def test_a_reworded_question_is_a_semantic_hit(backend_url: str, storage: str) -> None:
    spec = "{mode: semantic, similarity: 0.95}"
    with gateway(backend_url, storage, spec, embedder=EMBED) as url:
        ask(url)
        reworded = [{"role": "user", "content": "  what is the capital of   FRANCE? "}]
        hit = ask(url, messages=reworded)
        other_tenant = ask(url, COLLIDE_A_KEY, messages=reworded)
        other_context = ask(
            url, messages=[{"role": "system", "content": "Answer in French."}, *reworded]
        )
        sampled = ask(url, messages=reworded, temperature=0.5, seed=1)
    assert hit.headers["x-tokenweir-cache"] == "semantic-hit"
    assert float(hit.headers["x-tokenweir-cache-similarity"]) > 0.99
    assert hit.json()["choices"][0]["message"]["content"]
    assert other_tenant.headers["x-tokenweir-cache"] == "miss"
    assert other_context.headers["x-tokenweir-cache"] == "miss"
    assert sampled.headers["x-tokenweir-cache"] == "miss"  # semantic only at temperature 0


def test_an_embedder_that_is_down_only_skips_the_cache(
    backend_url: str, backend: httpx.Client
) -> None:
    dead = "embedder: {model: dead-embed, timeout: 1s}"
    with gateway(backend_url, cache="{mode: semantic}", embedder=dead) as url:
        first, second = ask(url), ask(url)
    assert (first.status_code, first.headers["x-tokenweir-cache"]) == (200, "miss")
    assert first.json()["choices"][0]["message"]["content"]
    assert second.headers["x-tokenweir-cache"] == "hit"  # the exact cache still works


@pytest.mark.parametrize("charged", [False, True])
@pytest.mark.anyio
async def test_a_hit_is_in_the_ledger_with_what_it_saved(
    backend_url: str, tmp_path: Path, charged: bool
) -> None:
    database = tmp_path / "ledger.db"
    policy = cache_policy(
        backend_url, "memory", "{mode: exact}", ledger=f"ledger: sqlite:///{database}"
    )
    alpha = policy.tenants["alpha"]
    budget = alpha.budget.model_copy(update={"charge_cache_hits": charged})
    tenants = {**policy.tenants, "alpha": alpha.model_copy(update={"budget": budget})}
    with serve(create_app(policy.model_copy(update={"tenants": tenants}))) as url:
        miss, hit = ask(url), ask(url)
    assert hit.headers["x-tokenweir-cache"] == "hit"
    ledger = open_ledger(f"sqlite:///{database}", read_only=True)
    await ledger.start()
    try:
        records = {r.cache: r for r in await ledger.latest("alpha", 10)}
    finally:
        await ledger.aclose()
    usage = miss.json()["usage"]
    saved = records["hit"]
    assert (saved.saved_input_tokens, saved.saved_output_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert saved.saved_cost_nusd == records["miss"].cost_nusd > 0
    billed = (saved.input_tokens, saved.output_tokens, saved.cost_nusd)
    if charged:
        assert billed == (usage["prompt_tokens"], usage["completion_tokens"], saved.saved_cost_nusd)
    else:
        assert billed == (0, 0, 0)


def test_replicas_on_one_redis_share_the_cache(backend_url: str, redis_url: str) -> None:
    spec = "{mode: semantic, similarity: 0.95}"
    with (
        gateway(backend_url, redis_url, spec, embedder=EMBED) as one,
        gateway(backend_url, redis_url, spec, embedder=EMBED) as two,
    ):
        ask(one)
        exact = ask(two)
        reworded = ask(
            two, messages=[{"role": "user", "content": "WHAT is the capital of France?"}]
        )
    assert exact.headers["x-tokenweir-cache"] == "hit"
    assert reworded.headers["x-tokenweir-cache"] == "semantic-hit"


def test_cache_storage_that_is_down_only_skips_the_cache(backend_url: str) -> None:
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"
    with gateway(backend_url, dead_redis) as url:
        first, second = ask(url), ask(url)
    assert (first.status_code, second.status_code) == (200, 200)
    assert [a.headers["x-tokenweir-cache"] for a in (first, second)] == ["bypass", "bypass"]
    assert second.json()["choices"][0]["message"]["content"]


def test_semantic_answers_past_max_entries_leave_no_vectors_behind(
    backend_url: str, redis_url: str
) -> None:
    """Many conversations a second past max_entries, on Redis: each stored answer is kept and
    an older one evicted with its vector (and its conversation's stream, emptied). The script
    sometimes evicted the answer it had just stored (its score, a whole second, ties with the
    others'), then wrote its vector and its location, which no eviction ever reached: the
    tenant's vectors grew without bound; and an emptied stream stayed, one a conversation."""
    spec = "{mode: semantic, max_entries: 5, similarity: 0.999}"
    with gateway(backend_url, redis_url, spec, embedder=EMBED) as url:
        with ThreadPoolExecutor(8) as pool:
            answers = pool.map(
                lambda i: ask(
                    url, messages=[*conversation(i), {"role": "user", "content": "More?"}]
                ),
                range(80),
            )
            assert {answer.status_code for answer in answers} == {200}
    with redis.Redis.from_url(redis_url) as admin:
        streams = list(admin.scan_iter(match="tw:{alpha}:cache:v:*"))
        vectors = sum(int(admin.xlen(stream)) for stream in streams)
        located = int(admin.hlen("tw:{alpha}:cache:vec"))
        kept = int(admin.zcard("tw:{alpha}:cache:lru"))
    assert kept == 5
    assert (located, vectors) == (5, 5)
    assert len(streams) <= 5  # each conversation's stream goes with its last vector


def conversation(i: int) -> list[dict[str, str]]:
    """A conversation of its own (a partition of the semantic cache) before its last question."""
    return [
        {"role": "user", "content": f"Fact {i}: {i * 7919}"},
        {"role": "assistant", "content": f"It is {i}."},
    ]
