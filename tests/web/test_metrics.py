"""`GET /metrics`: the GenAI histograms and gateway counters, parsed as Prometheus parses them."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from proxy.tools.mock import backend as mockbackend
from tests.conftest import ALPHA_KEY, make_policy
from tests.servers import free_port, serve
from tests.telemetry.conftest import extra_tenant

LIMITED_KEY = "tw-test-limited"
CACHED_KEY = "tw-test-cached"
METERED_KEY = "tw-test-metered"
MEMO_KEY = "tw-test-memo"
EXTRA = (
    extra_tenant(
        "limited", LIMITED_KEY, budget="{tokens_per_day: 100000}", limits="{requests_per_minute: 1}"
    )
    + f"""
  cached:
    api_keys: [{hash_key(CACHED_KEY)}]
    models: [mock-llm]
    cache: {{mode: exact}}
  metered:
    api_keys: [{hash_key(METERED_KEY)}]
    models: [mock-llm]
  memo:
    api_keys: [{hash_key(MEMO_KEY)}]
    models: [mock-llm]
    cache: {{mode: exact}}
    limits: {{requests_per_minute: 2}}
"""
)


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    """A gateway on a backend that sends a token every 20 ms: a stream's tokens come in reads of
    their own even on a loaded machine (at the suite's 2,000 tokens/s a 6 ms stall sent a
    12-token stream in one read, so the gateway wrote one chunk and measured no gap)."""
    with (
        serve(mockbackend.create_app(ttft_ms=0, tokens_per_second=50)) as backend_url,
        serve(create_app(make_policy(backend_url, extra=EXTRA))) as url,
    ):
        yield url


def scrape(url: str) -> dict[str, list[Sample]]:
    answer = httpx.get(url + "/metrics")
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain")
    samples: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(samples: dict[str, list[Sample]], name: str, **labels: str) -> float:
    found = [s.value for s in samples.get(name, []) if labels.items() <= s.labels.items()]
    return sum(found)


def test_requests_land_in_genai_histograms(gateway: str) -> None:
    with openai.OpenAI(base_url=gateway + "/v1", api_key=ALPHA_KEY, max_retries=0) as client:
        list(client.chat.completions.create(
            model="mock-llm", messages=[{"role": "user", "content": "hi"}], max_tokens=12,
            stream=True,
        ))  # fmt: skip
        client.chat.completions.create(
            model="mock-llm", messages=[{"role": "user", "content": "hi"}], max_tokens=5
        )
    httpx.post(gateway + "/v1/chat/completions", json={}, headers={"authorization": "Bearer x"})
    samples = scrape(gateway)
    ok = {"tenant": "alpha", "gen_ai_request_model": "mock-llm", "status_class": "2xx"}
    assert value(samples, "tokenweir_requests_total", **ok) == 2
    assert value(samples, "tokenweir_requests_total", tenant="", status_class="4xx") == 1
    output = {**ok, "gen_ai_token_type": "output"}
    assert value(samples, "gen_ai_client_token_usage_count", **output) == 2
    assert value(samples, "gen_ai_client_token_usage_sum", **output) == 17
    # Streams only: one TTFT each, and a gap per chunk after the first (12 tokens 20 ms apart
    # come in 12 reads unless the machine stalls the gateway for longer).
    assert value(samples, "gen_ai_server_time_to_first_token_seconds_count", **ok) == 1
    assert value(samples, "gen_ai_client_operation_time_to_first_chunk_seconds_count", **ok) == 1
    chunk_gaps = "gen_ai_client_operation_time_per_output_chunk_seconds_count"
    assert 1 <= value(samples, chunk_gaps, **ok) <= 11
    assert value(samples, "gen_ai_server_time_per_output_token_seconds_count", **ok) >= 1
    assert value(samples, "gen_ai_client_operation_duration_seconds_count", **ok) == 2
    assert value(samples, "gen_ai_server_request_duration_seconds_count", **ok) == 2
    assert value(samples, "tokenweir_gateway_overhead_seconds_count", **ok) == 2
    assert value(samples, "tokenweir_cost_usd_total", **ok) > 0
    assert value(samples, "tokenweir_cache_requests_total", tenant="alpha", result="bypass") == 2
    assert value(samples, "tokenweir_inflight_streams", tenant="alpha") == 0


def test_token_usage_counts_only_requests_a_backend_answered(gateway: str) -> None:
    """A cache hit and a 429 of the gateway's own, which no backend was asked, went into
    `gen_ai_client_token_usage` as requests of 0 tokens each: its percentiles and mean per
    request fell with every refusal (the spec records it when an operation used tokens)."""
    body = {"model": "mock-llm", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
            "temperature": 0}  # fmt: skip
    headers = {"authorization": f"Bearer {MEMO_KEY}"}
    statuses = [
        (answer.status_code, answer.headers["x-tokenweir-cache"])
        for answer in (
            httpx.post(gateway + "/v1/chat/completions", json=body, headers=headers)
            for _ in range(3)
        )
    ]
    assert statuses == [(200, "miss"), (200, "hit"), (429, "bypass")]
    samples = scrape(gateway)
    assert value(samples, "tokenweir_requests_total", tenant="memo") == 3
    for kind in ("input", "output"):
        usage = {"tenant": "memo", "gen_ai_token_type": kind}
        assert value(samples, "gen_ai_client_token_usage_count", **usage) == 1, kind
    assert value(samples, "gen_ai_client_token_usage_sum", tenant="memo") > 3


def test_histograms_use_the_specs_bucket_boundaries(gateway: str) -> None:
    httpx.post(
        gateway + "/v1/chat/completions",
        json={"model": "mock-llm", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
        headers={"authorization": f"Bearer {ALPHA_KEY}"},
    ).raise_for_status()
    samples = scrape(gateway)

    def bounds(name: str) -> set[float]:
        return {float(s.labels["le"]) for s in samples[name + "_bucket"]}

    assert bounds("gen_ai_client_token_usage") >= {1, 4, 16, 64, 256, 1024, 67108864}
    assert bounds("gen_ai_client_operation_duration_seconds") >= {0.01, 0.02, 0.04, 81.92}
    assert bounds("gen_ai_server_request_duration_seconds") >= {0.01, 0.02, 0.04, 81.92}


def test_rate_limited_requests_and_budget_left(gateway: str) -> None:
    headers = {"authorization": f"Bearer {LIMITED_KEY}"}
    body = {"model": "mock-llm", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
    statuses = [
        httpx.post(gateway + "/v1/chat/completions", json=body, headers=headers).status_code
        for _ in range(2)
    ]
    assert statuses == [200, 429]
    samples = scrape(gateway)
    assert value(samples, "tokenweir_rejected_requests_total", tenant="limited") == 1
    assert (
        value(samples, "tokenweir_rejected_requests_total", tenant="limited", reason="rate_limit")
        == 1
    )
    left = value(samples, "tokenweir_budget_remaining_tokens", tenant="limited")
    assert 0 < left < 100000


def test_unknown_model_names_do_not_become_labels(gateway: str) -> None:
    body = {"model": "no-such-model-a81f", "messages": [{"role": "user", "content": "x"}]}
    httpx.post(
        gateway + "/v1/chat/completions", json=body,
        headers={"authorization": f"Bearer {ALPHA_KEY}"},
    )  # fmt: skip
    text = httpx.get(gateway + "/metrics").text
    assert "no-such-model-a81f" not in text
    assert 'gen_ai_request_model="other"' in text


def test_cache_hits_misses_and_what_hits_saved(gateway: str) -> None:
    with openai.OpenAI(base_url=gateway + "/v1", api_key=CACHED_KEY, max_retries=0) as client:
        answers = [
            client.chat.completions.create(
                model="mock-llm", messages=[{"role": "user", "content": "cache me"}],
                max_tokens=9, temperature=0,
            )
            for _ in range(3)
        ]  # fmt: skip
    usage = answers[0].usage
    assert usage is not None
    samples = scrape(gateway)
    cached = {"tenant": "cached", "gen_ai_request_model": "mock-llm"}
    assert value(samples, "tokenweir_cache_requests_total", **cached, result="miss") == 1
    assert value(samples, "tokenweir_cache_requests_total", **cached, result="hit") == 2
    saved = "tokenweir_cache_saved_tokens_total"
    assert value(samples, saved, **cached, gen_ai_token_type="input") == 2 * usage.prompt_tokens
    assert value(samples, saved, **cached, gen_ai_token_type="output") == 2 * 9
    assert value(samples, "tokenweir_cache_saved_usd_total", **cached) > 0


def test_a_stream_that_falls_back_to_another_model_is_counted_and_leaves_flight() -> None:
    """The in-flight gauge went up under the model asked for and down under the fallback that
    served: a KeyError after the stream's end, so the request was never counted nor logged,
    and the asked-for model's gauge stayed up for good."""
    down = f"http://127.0.0.1:{free_port()}"  # nobody listens: the model falls back
    with serve(mockbackend.create_app(ttft_ms=0, tokens_per_second=2000)) as backend_url:
        text = f"""
upstream: {{probe_interval: 0}}
backends:
  - {{name: down, url: "{down}/v1", models: [big]}}
  - {{name: small, url: "{backend_url}/v1", models: [small]}}
models: {{big: {{fallback_models: [small]}}, small: {{}}}}
tenants:
  t: {{api_keys: [{hash_key(ALPHA_KEY)}], models: [big]}}
"""
        with (
            serve(create_app(parse_policy(text, environ={}))) as url,
            openai.OpenAI(base_url=url + "/v1", api_key=ALPHA_KEY, max_retries=0) as sdk,
        ):
            chunks = sdk.chat.completions.create(
                model="big", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            assert [c.model for c in chunks if c.choices][-1] == "small"
            samples = _once_counted(url)
    assert [s.value for s in samples["tokenweir_inflight_streams"]] == [0.0]


def _once_counted(url: str) -> dict[str, list[Sample]]:
    """The metrics once the request is counted: that happens just after its last byte."""
    deadline = time.monotonic() + 10
    while True:
        samples = scrape(url)
        if value(samples, "tokenweir_requests_total", tenant="t") == 1:
            return samples
        assert time.monotonic() < deadline, "the request was not counted within 10 s"
        time.sleep(0.05)


def test_the_cost_counter_is_the_requests_exact_cost_not_a_drifting_float_sum(
    gateway: str,
) -> None:
    """Each request's dollars were added to a float: after 40 requests the counter read
    0.00014110000000000001 where their costs sum to 141,100 nano-USD, and it drifted further
    from the ledger's integers with every request. Now the counter sums nano-USD as integers
    and shows their total in dollars."""
    total_nusd = 0
    with openai.OpenAI(base_url=gateway + "/v1", api_key=METERED_KEY, max_retries=0) as client:
        for i in range(40):
            answer = client.chat.completions.create(
                model="mock-llm", messages=[{"role": "user", "content": "word " * (i % 7 + 1)}],
                max_tokens=i % 13 + 1,
            )  # fmt: skip
            assert answer.usage is not None
            # mock-llm is priced 0.1 and 0.4 USD per million tokens: 100 and 400 nano-USD each
            total_nusd += answer.usage.prompt_tokens * 100 + answer.usage.completion_tokens * 400
    samples = scrape(gateway)
    cost = value(samples, "tokenweir_cost_usd_total", tenant="metered")
    assert cost == total_nusd / 1e9
