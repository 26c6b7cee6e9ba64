"""The gateway's own TTFT, ITL and tokens/s read back what the simulated backend was set to."""

from __future__ import annotations

import logging
import time

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import create_app
from proxy.tools.mock import backend as mockbackend
from tests.conftest import ALPHA_KEY, make_policy
from tests.servers import serve
from tests.tools.backendclock import BackendClock, worst_stall

TTFT_MS = 200.0
TOKENS_PER_S = 100.0


def near(measured: float, expected: float, rel: float, slack_s: float) -> bool:
    return abs(measured - expected) <= rel * expected + slack_s


def test_meter_matches_the_backends_pace_within_10_percent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Judged against what the backend's own clock saw it do, within 10% plus three times the
    worst stall a probe thread saw meanwhile (near 0 on an idle machine); never less."""
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    backend = BackendClock(mockbackend.create_app(ttft_ms=TTFT_MS, tokens_per_second=TOKENS_PER_S))
    with serve(backend) as backend_url, serve(create_app(make_policy(backend_url))) as url:
        with worst_stall() as stall:
            with openai.OpenAI(base_url=url + "/v1", api_key=ALPHA_KEY, max_retries=0) as sdk:
                list(sdk.chat.completions.create(
                    model="mock-llm", messages=[{"role": "user", "content": "pace"}],
                    max_tokens=40, stream=True,
                ))  # fmt: skip
        deadline = time.monotonic() + 10
        while not [r for r in caplog.records if r.name == "tokenweir.access"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        metrics = httpx.get(url + "/metrics").text
    [line] = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "tokenweir.access"]
    [sent] = backend.timelines
    slack_s = 3 * stall[0]
    assert line["ttft_ms"] / 1000 >= sent.ttft_s
    assert near(line["ttft_ms"] / 1000, sent.ttft_s, 0.10, slack_s), (line, sent.ttft_s, slack_s)
    # The log's p50 is the middle of a 12%-wide histogram bucket: exact to ±6% by itself.
    itl_s = sorted(sent.gaps_s())[len(sent.gaps_s()) // 2]
    assert near(line["itl_p50_ms"] / 1000, itl_s, 0.16, slack_s), (line, itl_s, slack_s)
    # Speeds are 39 gaps over a span: the slack, a time, widens the span.
    assert near(39 / line["tokens_per_s"], sent.span_s, 0.10, slack_s), (line, sent.span_s)
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    ttft = {s.name: s.value for s in families["gen_ai_server_time_to_first_token_seconds"].samples}
    ttft_sum = ttft["gen_ai_server_time_to_first_token_seconds_sum"]
    assert near(ttft_sum, sent.ttft_s, 0.10, slack_s), (ttft_sum, sent.ttft_s, slack_s)
    tpot = families["gen_ai_server_time_per_output_token_seconds"].samples
    tpot_sum = next(s.value for s in tpot if s.name.endswith("_sum"))
    assert near(39 * tpot_sum, sent.span_s, 0.10, slack_s), (tpot_sum, sent.span_s, slack_s)
    # One gap per read with text after the first: 39 unless a loaded machine merged reads.
    gaps = families["gen_ai_client_operation_time_per_output_chunk_seconds"].samples
    count = next(s.value for s in gaps if s.name.endswith("_count"))
    total = next(s.value for s in gaps if s.name.endswith("_sum"))
    assert 1 <= count <= 39
    assert near(total, sent.span_s, 0.10, slack_s), (total, sent.span_s, slack_s)
