"""The mock's simulated replica: TTFT grows with load, drops when the prompt prefix is cached."""

from __future__ import annotations

import httpx

from proxy.tools.mock import backend as mockbackend
from proxy.tools.mock.sim import LoadModel
from tests.servers import serve
from tests.tools.backendclock import BackendClock


def _body(system: str) -> dict[str, object]:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "q"}]}


def test_a_cached_prefix_prefills_only_the_rest_of_the_prompt() -> None:
    model = LoadModel(load_ttft_s=0.0, prefill_s_per_token=0.001, prefix_cache_size=1)
    system = " ".join(["word"] * 96)  # 96 words + 4 per message = 100 cached tokens
    assert model.extra_ttft_s(_body(system), 120, 0) == 0.12
    assert abs(model.extra_ttft_s(_body(system), 120, 0) - 0.02) < 1e-9
    model.extra_ttft_s(_body("another prompt"), 120, 0)  # evicts the first (LRU of one)
    assert model.extra_ttft_s(_body(system), 120, 0) == 0.12
    assert (model.prefix_hits, model.prefix_misses) == (1, 3)


def test_ttft_grows_with_requests_in_flight() -> None:
    model = LoadModel(load_ttft_s=0.01, prefill_s_per_token=0.0, prefix_cache_size=0)
    assert model.extra_ttft_s(_body("s"), 10, 0) == 0.0
    assert abs(model.extra_ttft_s(_body("s"), 10, 3) - 0.03) < 1e-9


def test_the_served_mock_reports_prefix_hits() -> None:
    # Timed by the backend's own clock (arrival to answer), so a loaded client adds nothing.
    app = BackendClock(mockbackend.create_app(prefill_ms_per_1k_tokens=2000, prefix_cache=4))
    system = " ".join(["long"] * 500)
    body = {"model": "mock-llm", "max_tokens": 1, **_body(system)}
    with serve(app) as url:
        httpx.post(url + "/v1/chat/completions", json=body).raise_for_status()
        httpx.post(url + "/v1/chat/completions", json=body).raise_for_status()
        stats = httpx.get(url + "/mock/stats").json()
    assert (stats["prefix_hits"], stats["prefix_misses"]) == (1, 1)
    cold_s, warm_s = (timeline.e2e_s for timeline in app.timelines)
    assert cold_s > 0.9  # 500 tokens at 2 s per 1k
    assert warm_s < cold_s / 2
