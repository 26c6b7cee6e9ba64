"""Budgets through the real gateway: shaping the backend sees, quotas that hold under a race."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import redis

from proxy.app import create_app
from proxy.clock import FakeClock
from proxy.policy import Policy, parse_policy
from proxy.policy.units import hash_key
from proxy.storage import Counter, MemoryStore
from tests.redis_server import wait_until
from tests.servers import free_port, serve

KEY = "tw-budget-key"


def budget_policy_text(backend_url: str, budget: str, storage: str = "memory") -> str:
    return f"""
storage: {storage}
backends: [{{name: mock, url: "{backend_url}/v1", models: [mock-llm]}}]
models: {{mock-llm: {{price: {{input_per_1m: 1.0, output_per_1m: 2.0}}}}}}
tenants:
  support-bot:
    api_keys: [{hash_key(KEY)}]
    models: [mock-llm]
    budget: {budget}
"""


def budget_policy(backend_url: str, budget: str) -> Policy:
    return parse_policy(budget_policy_text(backend_url, budget), environ={})


def day_counter() -> Counter:
    day = time.strftime("%Y%m%d", time.gmtime())
    return Counter(f"tw:{{support-bot}}:q:tokens:d:{day}", 0, 0)


def test_shaping_reaches_the_backend_and_is_announced(
    backend_url: str, backend: httpx.Client
) -> None:
    budget = "{system_prompt: 你是智能客服助手, max_output_tokens: 8, "
    budget += "history_limit: 1, temperature: 0.2}"
    with serve(create_app(budget_policy(backend_url, budget))) as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        raw = sdk.chat.completions.with_raw_response.create(
            model="mock-llm",
            messages=[
                {"role": "user", "content": "old question"},
                {"role": "assistant", "content": "old answer"},
                {"role": "user", "content": "new question"},
            ],
            max_tokens=500,
        )
        reply = raw.parse()
    assert raw.headers["x-tokenweir-shaped"] == "system_prompt,history,max_tokens,temperature"
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 8
    sent = backend.get("/mock/stats").json()["last_request"]
    assert sent["messages"] == [
        {"role": "system", "content": "你是智能客服助手"},
        {"role": "user", "content": "new question"},
    ]
    assert (sent["max_tokens"], sent["temperature"]) == (8, 0.2)


def test_input_over_the_limit_is_context_length_exceeded(backend_url: str) -> None:
    """The error names the field that holds the input: it named `messages` on every route."""
    with serve(create_app(budget_policy(backend_url, "{max_input_tokens: 20}"))) as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.BadRequestError) as chat:
            sdk.chat.completions.create(
                model="mock-llm", messages=[{"role": "user", "content": "word " * 200}]
            )
        with pytest.raises(openai.BadRequestError) as completion:
            sdk.completions.create(model="mock-llm", prompt=["word " * 100, "word " * 100])
        with pytest.raises(openai.BadRequestError) as embedding:
            sdk.embeddings.create(model="mock-llm", input=[[1] * 15, [2] * 15])
    refusals = [(e.value.code, e.value.param) for e in (chat, completion, embedding)]
    assert refusals == [
        ("context_length_exceeded", "messages"),
        ("context_length_exceeded", "prompt"),
        ("context_length_exceeded", "input"),
    ]
    assert "shorten the input" in str(embedding.value)


def test_a_completions_suffix_counts_toward_the_input_limit(
    backend_url: str, backend: httpx.Client
) -> None:
    """A fill-in-the-middle backend (Ollama's /v1/completions) reads `suffix` as input beside
    each prompt, but only the prompt was counted: 1,000 words of suffix passed a 20-token
    `max_input_tokens` (and `tokens_per_minute`) uncounted."""
    with serve(create_app(budget_policy(backend_url, "{max_input_tokens: 20}"))) as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.completions.create(model="mock-llm", prompt="def f(", suffix=" word" * 1000)
        with pytest.raises(openai.BadRequestError):  # the suffix beside each of 4 prompts
            sdk.completions.create(model="mock-llm", prompt=["def f("] * 4, suffix=" word" * 4)
        fits = sdk.completions.create(model="mock-llm", prompt="def f(", suffix=" word" * 4)
    assert caught.value.code == "context_length_exceeded"
    assert fits.choices


def test_quota_refuses_with_insufficient_quota_once_spent(backend_url: str) -> None:
    with serve(create_app(budget_policy(backend_url, "{tokens_per_day: 100}"))) as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        ask = {
            "model": "mock-llm",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 40,
        }
        sdk.chat.completions.create(**ask)  # type: ignore[call-overload]
        sdk.chat.completions.create(**ask)  # type: ignore[call-overload]
        with pytest.raises(openai.RateLimitError) as caught:
            sdk.chat.completions.create(**ask)  # type: ignore[call-overload]
    assert caught.value.code == "insufficient_quota"
    assert int(caught.value.response.headers["retry-after"]) > 0


def test_a_quota_only_requests_in_flight_hold_is_a_rate_limit_not_insufficient_quota(
    backend_url: str,
) -> None:
    """A request that fits beside what is used, refused only for what a request in flight
    holds, was `insufficient_quota`: OpenAI's "check your plan and billing" that clients stop
    on, for a quota back in a second. It is `rate_limit_exceeded`, and served once that ends."""
    store = MemoryStore()
    ask = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300}
    with (
        serve(create_app(budget_policy(backend_url, "{tokens_per_day: 2000}"), store=store)) as url,
        ThreadPoolExecutor(1) as pool,
    ):
        slow = {**ask, "max_tokens": 1800, "mock_delay_ms": 3000}
        headers = {"authorization": f"Bearer {KEY}"}
        holding = pool.submit(httpx.post, url + "/v1/chat/completions", json=slow, headers=headers)
        held = lambda: asyncio.run(store.read([day_counter()]))[0][1] > 1800  # noqa: E731
        wait_until(held, "the slow request's reservation")
        sdk = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.RateLimitError) as caught:
            sdk.chat.completions.create(**ask)  # type: ignore[call-overload]
        assert holding.result(timeout=30).status_code == 200
        served = sdk.chat.completions.create(**ask)  # type: ignore[call-overload]
    refusal = caught.value
    assert (refusal.code, refusal.type) == ("rate_limit_exceeded", "rate_limit_error")
    assert "Requests in flight hold this quota" in refusal.message
    assert refusal.response.headers["retry-after"] == "1"
    assert served.usage is not None


def test_a_usd_quota_on_an_unpriced_model_still_books_and_enforces_tokens_on_redis(
    backend_url: str, redis_url: str
) -> None:
    """An unpriced model costs nothing, so its USD quota reserves 0: every request is still
    booked on the token quota (Redis once failed to settle such a reservation, so the tokens
    were never counted and the quota never refused)."""
    text = budget_policy_text(backend_url, "{tokens_per_day: 60, usd_per_day: 1}", redis_url)
    text = text.replace("{price: {input_per_1m: 1.0, output_per_1m: 2.0}}", "{}")
    ask = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    spent, refused = 0, None
    with serve(create_app(parse_policy(text, environ={}))) as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        for _ in range(20):
            try:
                reply = sdk.chat.completions.create(**ask)  # type: ignore[call-overload]
            except openai.RateLimitError as refusal:
                refused = refusal.code
                break
            assert reply.usage is not None
            spent += reply.usage.total_tokens
    assert refused == "insufficient_quota"
    assert 0 < spent <= 60
    with redis.Redis.from_url(redis_url) as admin:
        booked = admin.hmget(day_counter().key, "used", "reserved")
    assert [int(v or 0) for v in booked] == [spent, 0]


async def stream_once(http: httpx.AsyncClient, body: dict[str, object]) -> int:
    async with http.stream("POST", "/v1/chat/completions", json=body) as answer:
        async for _ in answer.aiter_bytes():
            pass
        return answer.status_code


def test_200_racing_streams_never_overspend_the_quota(backend_url: str) -> None:
    # Each request reserves its counted input + 40 output tokens; the quota holds about 50.
    store = MemoryStore()
    quota = 50 * 60
    policy = budget_policy(backend_url, f"{{tokens_per_day: {quota}, max_output_tokens: 40}}")
    body = {
        "model": "mock-llm",
        "stream": True,
        "messages": [{"role": "user", "content": "supercalifragilistic"}],
    }
    with serve(create_app(policy, store=store)) as url:

        async def race() -> list[int]:
            limits = httpx.Limits(max_connections=200)
            headers = {"authorization": f"Bearer {KEY}"}
            async with httpx.AsyncClient(
                base_url=url, headers=headers, limits=limits, timeout=30
            ) as http:
                return await asyncio.gather(*(stream_once(http, body) for _ in range(200)))

        statuses = asyncio.run(race())
        [(used, reserved)] = asyncio.run(store.read([day_counter()]))
    admitted = statuses.count(200)
    assert statuses.count(429) == 200 - admitted
    # Early finishers settle at their real use (45 tokens), below their reservation.
    assert 40 <= admitted <= quota // 45
    assert reserved == 0
    assert used <= quota


def test_disconnect_mid_stream_bills_what_was_sent(backend_url: str, backend: httpx.Client) -> None:
    store = MemoryStore()
    policy = budget_policy(backend_url, "{tokens_per_day: 1000000, max_output_tokens: 5000}")
    body = {
        "model": "mock-llm",
        "stream": True,
        "max_tokens": 5000,
        "mock_completion_tokens": 5000,
        "messages": [{"role": "user", "content": "tell me everything"}],
    }
    headers = {"authorization": f"Bearer {KEY}"}
    with (
        serve(create_app(policy, store=store)) as url,
        httpx.Client(base_url=url, headers=headers) as http,
    ):
        with http.stream("POST", "/v1/chat/completions", json=body) as answer:
            lines = answer.iter_lines()
            for _ in range(40):
                next(lines)
            answer.close()
        deadline = time.monotonic() + 5
        while True:
            [(used, reserved)] = asyncio.run(store.read([day_counter()]))
            if reserved == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.02)
    sent = backend.get("/mock/stats").json()["tokens_sent"]
    assert reserved == 0
    # Billed: the counted input plus the tokens relayed before the client left, not 5,000.
    assert 10 < used < 200
    assert used <= sent + 20


def test_stop_stream_at_budget_ends_the_stream_cleanly_at_what_is_left(backend_url: str) -> None:
    budget = "{tokens_per_day: 100, stop_stream_at_budget: true}"
    with serve(create_app(budget_policy(backend_url, budget))) as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        ask = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]}
        first = sdk.chat.completions.create(**ask, max_tokens=60)  # type: ignore[call-overload]
        spent = first.usage.total_tokens
        raw = sdk.chat.completions.with_raw_response.create(
            **ask, max_tokens=60, stream=True, stream_options={"include_usage": True}
        )  # type: ignore[call-overload]
        chunks = list(raw.parse())
    assert raw.headers["x-tokenweir-shaped"] == "budget"
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == ["length"]
    assert chunks[-1].usage is not None
    assert spent + chunks[-1].usage.total_tokens <= 100
    assert 0 < chunks[-1].usage.completion_tokens < 60


def test_completions_take_their_bound_in_max_tokens_alone(
    backend_url: str, backend: httpx.Client
) -> None:
    """Completions backends read only max_tokens: chat's max_completion_tokens there would bound
    the reservation and not the answer, so it is refused, and a null max_tokens gets the bound."""
    store = MemoryStore()
    policy = budget_policy(backend_url, "{max_output_tokens: 16, tokens_per_day: 2000}")
    ask = {"model": "mock-llm", "prompt": "hello there", "mock_completion_tokens": 1500}
    headers = {"authorization": f"Bearer {KEY}"}
    with (
        serve(create_app(policy, store=store)) as url,
        httpx.Client(base_url=url, headers=headers) as http,
    ):
        bypass = {**ask, "max_completion_tokens": 1, "max_tokens": None}
        refused = http.post("/v1/completions", json=bypass)
        assert backend.get("/mock/stats").json()["requests_total"] == 0
        assert asyncio.run(store.read([day_counter()])) == [(0, 0)]  # refused: billed nothing
        answer = http.post("/v1/completions", json={**ask, "max_tokens": None})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["param"], error["code"]) == ("max_completion_tokens", "unsupported_parameter")
    assert "max_tokens" in error["message"]
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-tokenweir-shaped"] == "max_tokens"
    assert answer.json()["usage"]["completion_tokens"] == 16
    assert backend.get("/mock/stats").json()["last_request"]["max_tokens"] == 16


@pytest.mark.parametrize(
    ("sent", "reaches_backend", "shaped"),
    [
        ({"max_completion_tokens": 1000, "max_tokens": None},
         {"max_completion_tokens": 16, "max_tokens": 16}, "max_tokens"),
        ({"max_completion_tokens": 8}, {"max_completion_tokens": 8, "max_tokens": 8}, None),
        ({"max_completion_tokens": 1000, "max_tokens": 4},
         {"max_completion_tokens": 16, "max_tokens": 4}, "max_tokens"),
    ],
)  # fmt: skip
def test_a_chat_bound_reaches_backends_that_read_only_max_tokens(
    backend_url: str,
    backend: httpx.Client,
    sent: dict[str, int | None],
    reaches_backend: dict[str, int],
    shaped: str | None,
) -> None:
    """Ollama and TGI read only max_tokens, vLLM prefers max_completion_tokens: whichever field
    a chat client sets, max_tokens carries the bound too, and none is above max_output_tokens."""
    policy = budget_policy(backend_url, "{max_output_tokens: 16, tokens_per_day: 100000}")
    body = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], **sent}
    with serve(create_app(policy)) as url:
        answer = httpx.post(
            url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"}
        )
    assert answer.status_code == 200, answer.text
    assert answer.headers.get("x-tokenweir-shaped") == shaped
    last = backend.get("/mock/stats").json()["last_request"]
    assert {name: last.get(name) for name in reaches_backend} == reaches_backend


def test_a_quota_reserves_for_the_larger_of_chats_two_bounds(
    backend_url: str, backend: httpx.Client
) -> None:
    """vLLM (and the mock) generate up to max_completion_tokens when both are set, so a small
    max_tokens beside a large max_completion_tokens must not shrink the reservation."""
    store = MemoryStore()
    policy = budget_policy(backend_url, "{tokens_per_day: 500}")
    ask = {
        "model": "mock-llm",
        "messages": [{"role": "user", "content": "hi"}],
        "mock_completion_tokens": 1000,
    }
    headers = {"authorization": f"Bearer {KEY}"}
    with (
        serve(create_app(policy, store=store)) as url,
        httpx.Client(base_url=url, headers=headers) as http,
    ):
        refused = http.post(
            "/v1/chat/completions", json={**ask, "max_completion_tokens": 1000, "max_tokens": 1}
        )
        admitted = http.post("/v1/chat/completions", json={**ask, "max_completion_tokens": 300})
        [(used, reserved)] = asyncio.run(store.read([day_counter()]))
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "insufficient_quota"
    assert admitted.status_code == 200, admitted.text
    assert admitted.json()["usage"]["completion_tokens"] == 300
    last = backend.get("/mock/stats").json()["last_request"]
    assert (last["max_completion_tokens"], last["max_tokens"]) == (300, 300)
    assert (used, reserved) == (admitted.json()["usage"]["total_tokens"], 0)


def test_a_reservation_covers_every_answer_of_n_and_of_a_prompt_batch(
    backend_url: str, backend: httpx.Client
) -> None:
    """max_output_tokens bounds each answer, as OpenAI's max_tokens does; the quota reserves it
    for every answer the backend generates: n, best_of, each prompt of a completions batch."""
    store = MemoryStore()
    policy = budget_policy(backend_url, "{max_output_tokens: 100, tokens_per_day: 1000}")
    hi = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]}
    full = {"mock_completion_tokens": 100}  # every answer runs to its bound
    never = [
        ("/v1/chat/completions", {**hi, "n": 128}),
        ("/v1/completions", {"model": "mock-llm", "prompt": ["a"] * 500, "max_tokens": 100}),
        ("/v1/completions", {"model": "mock-llm", "prompt": "a", "best_of": 20, "max_tokens": 100}),
    ]
    headers = {"authorization": f"Bearer {KEY}"}
    with (
        serve(create_app(policy, store=store)) as url,
        httpx.Client(base_url=url, headers=headers) as http,
    ):
        refused = [http.post(path, json={**body, **full}) for path, body in never]
        assert asyncio.run(store.read([day_counter()])) == [(0, 0)]  # refusals bill nothing
        four = http.post("/v1/chat/completions", json={**hi, **full, "n": 4})
        eight = http.post("/v1/chat/completions", json={**hi, **full, "n": 8})
        [(used, reserved)] = asyncio.run(store.read([day_counter()]))
    for answer in refused:
        assert answer.status_code == 429, answer.text
        assert "can never be admitted" in answer.json()["error"]["message"]
    assert four.status_code == 200, four.text
    assert len(four.json()["choices"]) == 4
    assert four.json()["usage"]["completion_tokens"] == 400
    assert eight.status_code == 429, eight.text  # 8 x 100 more does not fit what is left
    assert eight.json()["error"]["code"] == "insufficient_quota"
    assert backend.get("/mock/stats").json()["requests_total"] == 1
    # n > 1 bills the larger of the backend's usage and the gateway's own (estimated) count
    assert four.json()["usage"]["total_tokens"] <= used <= 1000
    assert reserved == 0


def test_a_usd_quota_reserves_at_the_costliest_model_that_may_answer(backend_url: str) -> None:
    """The model asked for is cheap, its fallback 1,000 times dearer, and the cheap one's only
    backend is down: reserved at the cheap price, one request spent 100 times the day's
    budget (and any number at once could); reserved at the fallback's, it is refused first."""
    down = f"http://127.0.0.1:{free_port()}"
    text = f"""
upstream: {{probe_interval: 0}}
backends:
  - {{name: down, url: "{down}/v1", models: [cheap]}}
  - {{name: up, url: "{backend_url}/v1", models: [dear]}}
models:
  cheap: {{price: {{input_per_1m: 1, output_per_1m: 1}}, fallback_models: [dear]}}
  dear: {{price: {{input_per_1m: 1000, output_per_1m: 1000}}}}
tenants:
  t: {{api_keys: [{hash_key(KEY)}], models: [cheap], budget: {{usd_per_day: 0.001}}}}
"""
    with (
        serve(create_app(parse_policy(text, environ={}))) as url,
        openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as sdk,
        pytest.raises(openai.RateLimitError) as caught,
    ):
        sdk.chat.completions.create(
            model="cheap", messages=[{"role": "user", "content": "hi"}], max_tokens=100
        )
    assert caught.value.code == "insufficient_quota"


def test_a_usd_quota_reserves_at_the_model_a_degradation_rule_switches_to(
    backend_url: str,
) -> None:
    """A rule that sends the tenant's requests to a 1,000 times dearer model fires after the
    reservation, made at the asked model's price: one request spent 100 times the day's budget.
    Reserved at the rule's model's price, it is refused first; a shadow rule changes nothing."""
    body = {"model": "cheap", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}
    for shadow, refused in ((False, True), (True, False)):
        text = f"""
backends: [{{name: up, url: "{backend_url}/v1", models: [cheap, dear]}}]
models:
  cheap: {{price: {{input_per_1m: 1, output_per_1m: 1}}}}
  dear: {{price: {{input_per_1m: 1000, output_per_1m: 1000}}}}
tenants:
  t:
    api_keys: [{hash_key(KEY)}]
    models: [cheap]
    budget: {{usd_per_day: 0.001}}
    degrade: [{{name: upgrade, when: {{}}, then: {{model: dear}}, shadow: {str(shadow).lower()}}}]
"""
        auth = {"authorization": f"Bearer {KEY}"}
        with serve(create_app(parse_policy(text, environ={}))) as url:
            answer = httpx.post(url + "/v1/chat/completions", json=body, headers=auth)
        assert answer.status_code == (429 if refused else 200), answer.text
        if refused:
            assert answer.json()["error"]["code"] == "insufficient_quota"


def test_a_long_running_gateway_forgets_the_quota_counters_of_past_days(
    backend_url: str,
) -> None:
    """A gateway on memory storage serving a tenant every day for 100 days: it holds the
    counters of the days and months running now (past ones swept), not one a day for good as it
    did."""
    store = MemoryStore()
    clock = FakeClock()
    policy = budget_policy(backend_url, "{tokens_per_day: 100000, usd_per_month: 10}")
    body = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    headers = {"authorization": f"Bearer {KEY}"}
    with serve(create_app(policy, clock=clock, store=store)) as url:
        for _ in range(100):
            answer = httpx.post(url + "/v1/chat/completions", json=body, headers=headers)
            assert answer.status_code == 200, answer.text
            clock.advance(86400)
    assert len(store._slots) <= 4  # this day's and month's, and at most the last ones
