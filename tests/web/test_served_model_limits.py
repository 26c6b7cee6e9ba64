"""per_model limits when a degradation rule sends a request to another model, through the real
gateway: the request counts on the model that serves it, once, and queues as a direct one does."""

from __future__ import annotations

import httpx
import pytest

from proxy.app import create_app
from proxy.policy import Policy, parse_policy
from proxy.policy.units import hash_key
from tests.reliability.state import slots_held
from tests.servers import serve
from tests.web.test_ratelimits import AUTH, CHAT, KEY, streams_at_once

SPILL = "[{name: spill, when: {}, then: {model: mock-small}}]"


def spilling_policy(
    backend_url: str, storage: str, limits: str, backend: str = "{}", degrade: str = SPILL
) -> Policy:
    """Every request for mock-llm is sent to mock-small by a degradation rule (`degrade`); the
    backend's own limits are `backend`."""
    return parse_policy(
        f"""
storage: {storage}
backends:
  - {{name: mock, url: "{backend_url}/v1", models: [mock-llm, mock-small], limits: {backend}}}
models: {{mock-llm: {{}}, mock-small: {{}}}}
tenants:
  app:
    api_keys: [{hash_key(KEY)}]
    models: [mock-llm, mock-small]
    limits: {limits}
    priority: high
    degrade: {degrade}
""",
        environ={},
    )


@pytest.mark.parametrize("storage", ["memory", "redis"])
def test_a_request_sent_to_another_model_takes_nothing_from_the_asked_models_limits(
    backend_url: str, redis_url: str, storage: str
) -> None:
    """mock-llm allows one at a time and 2 a minute; every request for it is served by
    mock-small, so none uses mock-llm's allowance. They used both models': a second request
    while one streamed was a 429 (max_concurrent on model mock-llm), and the third in a minute
    too, though mock-llm had served nothing."""
    limits = "{per_model: {mock-llm: {max_concurrent: 1, requests_per_minute: 2}}}"
    policy = spilling_policy(backend_url, redis_url if storage == "redis" else storage, limits)
    body = {**CHAT, "stream": True, "max_tokens": 5000, "mock_completion_tokens": 5000}
    with serve(create_app(policy)) as url, httpx.Client(base_url=url, headers=AUTH) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as first:
            lines = first.iter_lines()  # kept: a discarded iterator closes the response
            next(lines)
            meanwhile = http.post("/v1/chat/completions", json=CHAT)
        after = [http.post("/v1/chat/completions", json=CHAT) for _ in range(3)]
    assert meanwhile.status_code == 200, meanwhile.text
    assert meanwhile.headers["x-tokenweir-degraded"] == "spill"
    assert [answer.status_code for answer in after] == [200] * 3, after[-1].text
    if storage == "redis":
        assert slots_held(redis_url) == 0


def test_a_request_sent_to_a_full_model_waits_in_line_as_one_that_asked_for_it(
    backend_url: str, backend: httpx.Client, redis_url: str
) -> None:
    """With queue_timeout, a request spilled to mock-small (one at a time) waits for its slot,
    as a request that asked for mock-small does; it was refused at once with a 429."""
    limits = "{queue_timeout: 20s, per_model: {mock-small: {max_concurrent: 1}}}"
    with serve(create_app(spilling_policy(backend_url, redis_url, limits))) as url:
        statuses, seen = streams_at_once(url, backend, 4)
    assert statuses == [200] * 4
    assert max(seen) == 1
    assert slots_held(redis_url) == 0


@pytest.mark.parametrize("full", ["served model", "backend"])
def test_a_request_refused_at_the_route_gives_its_request_back(
    backend_url: str, redis_url: str, full: str
) -> None:
    """Three requests a minute: while one streams, two more are refused at the route, by the
    per_model limit of the model a rule sent them to (429) or by the backend's own limit (503).
    Refused before any backend was asked, they take nothing, and two more fit the minute after.
    They spent the tenant's requests_per_minute: a 429 for the rest of the minute, with one
    request served."""
    limits, backend, degrade = "{per_model: {mock-small: {max_concurrent: 1}}}", "{}", SPILL
    if full == "backend":
        limits, backend, degrade = "{}", "{max_concurrent: 1}", "[]"
    limits = limits.replace("{", "{requests_per_minute: 3, ", 1)
    policy = spilling_policy(backend_url, redis_url, limits, backend, degrade)
    body = {**CHAT, "stream": True, "max_tokens": 5000, "mock_completion_tokens": 5000}
    with serve(create_app(policy)) as url, httpx.Client(base_url=url, headers=AUTH) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as first:
            lines = first.iter_lines()  # kept: a discarded iterator closes the response
            next(lines)
            refused = [http.post("/v1/chat/completions", json=CHAT) for _ in range(2)]
        after = [http.post("/v1/chat/completions", json=CHAT) for _ in range(2)]
    assert [answer.status_code for answer in refused] == [429 if full != "backend" else 503] * 2
    assert [answer.status_code for answer in after] == [200, 200], after[-1].text
