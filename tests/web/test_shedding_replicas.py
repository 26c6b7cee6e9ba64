"""Priority shedding on replicas sharing Redis (or `serve --workers N`): each process saw only
its own requests in flight, so with two, neither ever saw a backend 80% full (each held about
half) and low-priority requests were never shed. A process now also goes by the backend's
count across replicas, as its slot pool in Redis reported it at the process's last admission
there, less the requests this process has ended since; one that admitted none there lately reads
that count from Redis."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import httpx

from proxy.policy.units import hash_key
from tests.redis_server import private_redis
from tests.servers import replicas

KEY, LOW_KEY, RULE_KEY = "tw-shed-normal", "tw-shed-low", "tw-shed-rule"
LONG = {
    "model": "mock-llm",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "max_tokens": 20000,
    "mock_completion_tokens": 20000,
}
SHORT = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _policy(backend_url: str, redis_url: str) -> str:
    return f"""
storage: {redis_url}
backends:
  - {{name: a, url: "{backend_url}/v1", models: [mock-llm], limits: {{max_concurrent: 10}}}}
models: {{mock-llm: {{}}}}
tenants:
  app: {{api_keys: [{hash_key(KEY)}], models: [mock-llm]}}
  batch: {{api_keys: [{hash_key(LOW_KEY)}], models: [mock-llm], priority: low}}
  ruled:
    api_keys: [{hash_key(RULE_KEY)}]
    models: [mock-llm]
    degrade: [{{name: short, when: {{inflight_ratio_above: 0.5}}, then: {{max_output_tokens: 1}}}}]
"""


def _hold_stream(stack: ExitStack, url: str) -> None:
    """One long stream held open on `url` until `stack` closes, admitted (first event read)."""
    headers = {"authorization": f"Bearer {KEY}"}
    answer = stack.enter_context(
        httpx.stream("POST", url + "/v1/chat/completions", json=LONG, headers=headers, timeout=30)
    )
    assert answer.status_code == 200
    lines = answer.iter_lines()
    next(lines)
    stack.callback(lines.close)


def _low(url: str, key: str = LOW_KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(url + "/v1/chat/completions", json=SHORT, headers=headers, timeout=30)


def test_low_priority_is_shed_by_the_load_of_every_replica(
    backend_url: str, tmp_path: Path
) -> None:
    config = tmp_path / "policy.yaml"
    with private_redis() as redis_url:
        config.write_text(_policy(backend_url, redis_url))
        with replicas(config, 2) as [(_, first), (_, second)]:
            assert _low(second).status_code == 200  # an idle backend: nothing shed
            with ExitStack() as stack:
                for _ in range(7):
                    _hold_stream(stack, first)
                with ExitStack() as own:
                    _hold_stream(own, second)  # 8 of 10 in flight, 1 of them here
                    shed = _low(second)
                    assert shed.status_code == 503, shed.text
                    assert shed.json()["error"]["code"] == "overloaded"
                # the second replica's stream ended: 7 of 10 by what it knows, under 80%
                assert _low(second).status_code == 200


def test_a_replica_that_admitted_nothing_lately_goes_by_every_replicas_load(
    backend_url: str, tmp_path: Path
) -> None:
    """8 of 10 slots held through the first replica: the second had admitted nothing there (or
    nothing for a second), so knew only its own none in flight. Low priority was not shed and
    a rule on `inflight_ratio_above: 0.5` did not fire."""
    config = tmp_path / "policy.yaml"
    with private_redis() as redis_url:
        config.write_text(_policy(backend_url, redis_url))
        with replicas(config, 2) as [(_, first), (_, second)], ExitStack() as stack:
            for _ in range(8):
                _hold_stream(stack, first)
            shed = _low(second)
            ruled = _low(second, RULE_KEY)
    assert shed.status_code == 503, shed.text
    assert shed.json()["error"]["code"] == "overloaded"
    assert ruled.headers["x-tokenweir-degraded"] == "short"
    assert ruled.json()["usage"]["completion_tokens"] == 1
