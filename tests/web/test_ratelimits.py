"""Rate limits through the real gateway, as the openai SDK and a burst of clients see them."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest
import redis

from proxy.app import create_app
from proxy.policy import Policy, parse_policy
from proxy.policy.units import hash_key
from proxy.tools.mock import backend as mockbackend
from tests.reliability.state import slots_held
from tests.servers import free_port, serve

KEY = "tw-limits-key"
AUTH = {"authorization": f"Bearer {KEY}"}
CHAT = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def limits_policy_text(
    backend_url: str,
    limits: str,
    storage: str = "memory",
    cache: str = "{}",
    budget: str = "{}",
    degrade: str = "[]",
) -> str:
    return f"""
storage: {storage}
backends: [{{name: mock, url: "{backend_url}/v1", models: [mock-llm]}}]
models: {{mock-llm: {{}}}}
tenants:
  app:
    api_keys: [{hash_key(KEY)}]
    models: [mock-llm]
    limits: {limits}
    cache: {cache}
    budget: {budget}
    degrade: {degrade}
"""


def limits_policy(backend_url: str, limits: str) -> Policy:
    return parse_policy(limits_policy_text(backend_url, limits), environ={})


def test_every_answer_carries_openai_rate_limit_headers(backend_url: str) -> None:
    policy = limits_policy(backend_url, "{requests_per_minute: 2, tokens_per_minute: 1000}")
    headers = {"authorization": f"Bearer {KEY}"}
    with serve(create_app(policy)) as url, httpx.Client(base_url=url, headers=headers) as http:
        first = http.post("/v1/chat/completions", json=CHAT)
        http.post("/v1/chat/completions", json=CHAT)
        refused = http.post("/v1/chat/completions", json=CHAT)
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert first.headers["x-ratelimit-reset-requests"] == "30s"
    assert first.headers["x-ratelimit-limit-tokens"] == "1000"
    assert first.headers["x-ratelimit-reset-tokens"].endswith(("ms", "s"))
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert "requests_per_minute: limit 2" in refused.json()["error"]["message"]
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert 25 <= int(refused.headers["retry-after"]) <= 30


def until_refused(client: openai.OpenAI) -> tuple[int, openai.RateLimitError]:
    """How many requests were admitted before the first refusal, and the refusal."""
    for admitted in range(1000):
        try:
            client.chat.completions.create(**CHAT)  # type: ignore[call-overload]
        except openai.RateLimitError as refusal:
            return admitted, refusal
    raise AssertionError("1,000 requests and none refused")


def test_sdk_retries_after_retry_after_and_succeeds(backend_url: str) -> None:
    # 60 requests per minute: a burst of 60, then one more every second.
    with serve(create_app(limits_policy(backend_url, "{requests_per_minute: 60}"))) as url:
        patient = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=3)
        hasty = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        # Until the first refusal: the burst, and one more for each second the burst took (a
        # loaded machine takes longer over it, so the bucket refills as it goes).
        burst_started_s = time.monotonic()
        admitted, refused = until_refused(hasty)
        refused_s = time.monotonic()
        assert 60 <= admitted <= 60 + (refused_s - burst_started_s) + 1
        # The SDK reads retry-after-ms first (then Retry-After): the next token's arrival.
        wait_s = int(refused.response.headers["retry-after-ms"]) / 1000
        assert 0 < wait_s <= 1
        reply = patient.chat.completions.create(**CHAT)  # type: ignore[call-overload]
        succeeded_s = time.monotonic() - refused_s
    assert reply.choices[0].message.content
    # No sooner than the bucket refilled (so the SDK waited as told), and not much later.
    assert wait_s - 0.05 <= succeeded_s < 5


async def stream(http: httpx.AsyncClient) -> int:
    body = {**CHAT, "stream": True, "max_tokens": 400, "mock_completion_tokens": 400}
    async with http.stream("POST", "/v1/chat/completions", json=body) as answer:
        async for _ in answer.aiter_bytes():
            pass
        return answer.status_code


def most_in_flight(backend: httpx.Client, stop: threading.Event, seen: list[int]) -> None:
    while not stop.is_set():
        seen.append(backend.get("/mock/stats").json()["inflight"])
        time.sleep(0.005)


def streams_at_once(url: str, backend: httpx.Client, count: int) -> tuple[list[int], list[int]]:
    """`count` streams sent at once: their statuses, and the backend's in-flight counts seen
    meanwhile."""
    stop, seen = threading.Event(), [0]
    watcher = threading.Thread(target=most_in_flight, args=(backend, stop, seen))

    async def burst() -> list[int]:
        headers = {"authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as http:
            return await asyncio.gather(*(stream(http) for _ in range(count)))

    watcher.start()
    try:
        return asyncio.run(burst()), seen
    finally:
        stop.set()
        watcher.join()


@pytest.mark.parametrize(
    ("limits", "ok"),
    [("{max_concurrent: 2}", 2), ("{max_concurrent: 2, queue_timeout: 10s}", 6)],
)
def test_max_concurrent_holds_with_streams(
    backend_url: str, backend: httpx.Client, limits: str, ok: int
) -> None:
    with serve(create_app(limits_policy(backend_url, limits))) as url:
        statuses, seen = streams_at_once(url, backend, 6)
    assert statuses.count(200) == ok
    assert statuses.count(429) == 6 - ok
    assert max(seen) <= 2


def test_a_backends_own_limit_is_shared_by_every_tenant(backend_url: str) -> None:
    other_key = "tw-limits-other"
    policy = parse_policy(
        f"""
backends:
  - {{name: small-gpu, url: "{backend_url}/v1", models: [mock-llm], limits: {{max_concurrent: 2}}}}
models: {{mock-llm: {{}}}}
tenants:
  app: {{api_keys: [{hash_key(KEY)}], models: [mock-llm], priority: high}}
  other: {{api_keys: [{hash_key(other_key)}], models: [mock-llm], priority: high}}
""",
        environ={},
    )
    body = {**CHAT, "stream": True, "max_tokens": 5000, "mock_completion_tokens": 5000}
    with serve(create_app(policy)) as url:
        with (
            httpx.stream("POST", url + "/v1/chat/completions", json=body,
                         headers={"authorization": f"Bearer {KEY}"}) as first,
            httpx.stream("POST", url + "/v1/chat/completions", json=body,
                         headers={"authorization": f"Bearer {KEY}"}) as second,
        ):  # fmt: skip
            # Keep the line iterators: a discarded one closes its response (a disconnect).
            streams = [first.iter_lines(), second.iter_lines()]
            for lines in streams:
                next(lines)
            full = httpx.post(
                url + "/v1/chat/completions", json=CHAT,
                headers={"authorization": f"Bearer {other_key}"},
            )  # fmt: skip
        after = httpx.post(
            url + "/v1/chat/completions",
            json=CHAT,
            headers={"authorization": f"Bearer {other_key}"},
        )
    assert full.status_code == 503
    assert full.json()["error"]["code"] == "upstream_unavailable"
    assert "'small-gpu' is at capacity: " in full.json()["error"]["message"]
    assert "max_concurrent: 2 requests in flight" in full.json()["error"]["message"]
    # the backend's limits, shared by every key: it once said "Rate limit reached for this key"
    assert "for the backend, shared by every key" in full.json()["error"]["message"]
    assert "this key" not in full.json()["error"]["message"]
    assert int(full.headers["retry-after"]) >= 1
    assert after.status_code == 200


def test_a_tenant_named_after_a_backend_shares_none_of_its_limits(backend_url: str) -> None:
    """A tenant named `backend:mock` had the scope of backend mock's own limits: its lone
    request took a slot of its own pool (5), then the backend's pool (1), the same key, held
    it, and every one of its requests was a 503 'at capacity' with nothing running."""
    text = limits_policy_text(backend_url, "{max_concurrent: 5}")
    text = text.replace("  app:", '  "backend:mock":')
    text = text.replace("models: [mock-llm]}]", "models: [mock-llm], limits: {max_concurrent: 1}}]")
    policy = parse_policy(text, environ={})
    with serve(create_app(policy)) as url:
        answers = [
            httpx.post(url + "/v1/chat/completions", json=CHAT, headers=AUTH) for _ in range(3)
        ]
    assert [answer.status_code for answer in answers] == [200] * 3, answers[0].text


@pytest.mark.parametrize("attempts", ["", ", max_attempts: 1"])
def test_a_full_backend_is_passed_over_for_one_that_admits_the_request(
    backend_url: str, attempts: str
) -> None:
    """Not a 503 while another backend of the model has room: the first pick too moves on.
    A backend passed over was sent nothing, so it is no attempt: with `max_attempts: 1` the
    request was refused 503 'at capacity' while big-gpu stood idle."""
    with serve(mockbackend.create_app()) as big_url:
        # Smooth weighted round robin at 1000:1 picks small-gpu first every time.
        policy = parse_policy(
            f"""
backends:
  - {{name: small-gpu, url: "{backend_url}/v1", models: [mock-llm], weight: 1000,
     limits: {{max_concurrent: 1}}}}
  - {{name: big-gpu, url: "{big_url}/v1", models: [mock-llm], weight: 1}}
models: {{mock-llm: {{routing: weighted{attempts}}}}}
tenants:
  app: {{api_keys: [{hash_key(KEY)}], models: [mock-llm], priority: high}}
""",
            environ={},
        )
        body = {**CHAT, "stream": True, "max_tokens": 5000, "mock_completion_tokens": 5000}
        auth = {"authorization": f"Bearer {KEY}"}
        with serve(create_app(policy)) as url:
            with httpx.stream(
                "POST", url + "/v1/chat/completions", json=body, headers=auth
            ) as held:
                lines = held.iter_lines()  # kept: a discarded iterator closes the response
                next(lines)
                passed_over = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=auth)
        big_served = httpx.get(big_url + "/mock/stats").json()["requests_total"]
    assert passed_over.status_code == 200
    assert big_served == 1


def test_a_client_that_leaves_frees_its_slot_at_once(backend_url: str) -> None:
    policy = limits_policy(backend_url, "{max_concurrent: 1}")
    body = {**CHAT, "stream": True, "max_tokens": 20000, "mock_completion_tokens": 20000}
    with (
        serve(create_app(policy)) as url,
        httpx.Client(base_url=url, headers={"authorization": f"Bearer {KEY}"}) as http,
    ):
        with http.stream("POST", "/v1/chat/completions", json=body) as answer:
            lines = answer.iter_lines()
            next(lines)
            assert http.post("/v1/chat/completions", json=CHAT).status_code == 429
            answer.close()  # the client leaves mid-stream
        deadline = time.monotonic() + 1
        while (status := http.post("/v1/chat/completions", json=CHAT).status_code) != 200:
            assert time.monotonic() < deadline, status
            time.sleep(0.01)


def test_tokens_per_minute_charges_every_answer_of_n_and_of_a_prompt_batch(
    backend_url: str,
) -> None:
    policy = limits_policy(backend_url, "{tokens_per_minute: 1000}")
    headers = {"authorization": f"Bearer {KEY}"}
    with serve(create_app(policy)) as url, httpx.Client(base_url=url, headers=headers) as http:
        four = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 100, "n": 4})
        batch = {"model": "mock-llm", "prompt": ["a"] * 20, "max_tokens": 100}
        refused = http.post("/v1/completions", json=batch)
    assert four.status_code == 200, four.text
    # charged the counted input and 4 answers of up to 100 tokens, trued up afterwards
    assert int(four.headers["x-ratelimit-remaining-tokens"]) < 1000 - 400
    assert refused.status_code == 429, refused.text
    assert "can never be admitted" in refused.json()["error"]["message"]


def served_elsewhere_policy(backend_url: str, redis_url: str, how: str) -> Policy:
    """Asked for mock-llm, served by mock-small (a degradation rule's switch, or a fallback
    once mock-llm's only backend refuses connections), limited to one at a time on it."""
    backends = f'[{{name: mock, url: "{backend_url}/v1", models: [mock-llm, mock-small]}}]'
    models = "{mock-llm: {}, mock-small: {}}"
    degrade = "[{name: spill, when: {}, then: {model: mock-small}}]"
    if how == "fallback":
        dead = f"http://127.0.0.1:{free_port()}/v1"
        backends = f"""
  - {{name: dead, url: "{dead}", models: [mock-llm]}}
  - {{name: mock, url: "{backend_url}/v1", models: [mock-small]}}"""
        models, degrade = "{mock-llm: {fallback_models: [mock-small]}, mock-small: {}}", "[]"
    small = "{max_concurrent: 1, requests_per_minute: 3}"
    return parse_policy(
        f"""
storage: {redis_url}
backends: {backends}
models: {models}
tenants:
  app:
    api_keys: [{hash_key(KEY)}]
    models: [mock-llm, mock-small]
    limits: {{requests_per_minute: 1000, per_model: {{mock-small: {small}}}}}
    degrade: {degrade}
""",
        environ={},
    )


@pytest.mark.parametrize("how", ["degrade", "fallback"])
def test_a_request_another_model_serves_is_held_to_that_models_limits(
    backend_url: str, backend: httpx.Client, redis_url: str, how: str
) -> None:
    """20 streams at once for mock-llm, each served by mock-small: its per_model limits (one
    at a time, 3 a minute) hold as they do for requests that ask for it. They were admitted on
    mock-llm's limits only, and all 20 ran on mock-small, 10 or more at once."""
    policy = served_elsewhere_policy(backend_url, redis_url, how)
    with serve(create_app(policy)) as url:
        began_s = time.monotonic()
        statuses, seen = streams_at_once(url, backend, 20)
        # Then one at a time until refused: 3 a minute in all (one more each 20 s taken).
        after: list[httpx.Response] = []
        while len(after) < 6 and (not after or after[-1].status_code == 200):
            after.append(httpx.post(url + "/v1/chat/completions", json=CHAT, headers=AUTH))
        took_s = time.monotonic() - began_s
    assert max(seen) == 1
    assert statuses.count(200) >= 1
    assert statuses.count(429) == 20 - statuses.count(200)
    served = statuses.count(200) + [a.status_code for a in after].count(200)
    assert 3 <= served <= 3 + took_s // 20
    refused = after[-1]
    assert refused.status_code == 429
    assert "on model mock-small" in refused.json()["error"]["message"]
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert slots_held(redis_url) == 0


def test_a_request_larger_than_a_backends_token_rate_is_not_worth_retrying(
    backend_url: str,
) -> None:
    """500 tokens asked of a backend that takes 100 a minute can never be sent to it: the 503
    says so and tells the SDK not to retry (it said `Retry-After: 1`, and the SDK retried)."""
    policy = parse_policy(
        f"""
backends:
  - name: small-gpu
    url: "{backend_url}/v1"
    models: [mock-llm]
    limits: {{tokens_per_minute: 100}}
models: {{mock-llm: {{}}}}
tenants:
  app: {{api_keys: [{hash_key(KEY)}], models: [mock-llm]}}
""",
        environ={},
    )
    with serve(create_app(policy)) as url:
        refused = httpx.post(
            url + "/v1/chat/completions", json={**CHAT, "max_tokens": 500}, headers=AUTH
        )
    assert refused.status_code == 503
    assert "'small-gpu' cannot take this request" in refused.json()["error"]["message"]
    assert refused.headers["x-should-retry"] == "false"
    assert refused.headers["retry-after"] == "60"  # DESIGN: on every 503; the limit's window


def test_a_backend_that_failed_gives_back_its_slot_and_tokens_as_the_request_moves_on(
    backend_url: str, redis_url: str
) -> None:
    """gpu-a answers 503 and the request fails over to gpu-b: gpu-a's own slot is free while
    gpu-b streams, and its tokens_per_minute is not charged what gpu-b generated (its slot was
    held to the end, and each such request drained 3,006 tokens of gpu-a's minute, so a
    recovered gpu-a was 'at capacity' with nothing running)."""
    with serve(mockbackend.create_app(fail_status=503)) as failing:
        policy = parse_policy(
            f"""
storage: {redis_url}
backends:
  - name: gpu-a
    url: "{failing}/v1"
    models: [mock-llm]
    limits: {{tokens_per_minute: 10000, max_concurrent: 1}}
  - {{name: gpu-b, url: "{backend_url}/v1", models: [mock-llm]}}
models: {{mock-llm: {{}}}}
tenants:
  app: {{api_keys: [{hash_key(KEY)}], models: [mock-llm]}}
""",
            environ={},
        )
        body = {**CHAT, "stream": True, "max_tokens": 3000, "mock_completion_tokens": 3000}
        with serve(create_app(policy)) as url:
            with httpx.stream(
                "POST", url + "/v1/chat/completions", json=body, headers=AUTH
            ) as answer:
                lines = answer.iter_lines()
                next(lines)
                held_meanwhile = slots_held(redis_url)
                for _ in lines:
                    pass
            tried_a = httpx.get(failing + "/mock/stats").json()["requests_total"]
    assert answer.status_code == 200
    assert tried_a == 1  # gpu-a was tried first
    assert held_meanwhile == 0
    with redis.Redis.from_url(redis_url) as client:
        assert not client.exists("tw:backend:{gpu-a}:rl:tpm")  # full: nothing charged
