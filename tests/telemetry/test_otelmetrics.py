"""With OTLP metrics configured, a real `tokenweir serve` exports the same figures `/metrics`
shows, under the GenAI names, units and bucket boundaries, to a collector."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.sdk.resources import Resource
from prometheus_client.parser import text_string_to_metric_families

from proxy.ledger import LedgerStats
from proxy.telemetry import semconv
from proxy.telemetry.metrics import GatewayMetrics
from proxy.telemetry.otlpmetrics import NAMES, metrics_data
from proxy.tools.mock import backend as mockbackend
from tests.conftest import ALPHA_KEY
from tests.servers import replicas, serve
from tests.telemetry.collector import Collector, collector, policy_file

PAIRS = {  # OpenTelemetry name -> the Prometheus family /metrics shows
    "gen_ai.server.time_to_first_token": "gen_ai_server_time_to_first_token_seconds",
    "gen_ai.server.request.duration": "gen_ai_server_request_duration_seconds",
    "gen_ai.client.operation.duration": "gen_ai_client_operation_duration_seconds",
    "gen_ai.client.operation.time_per_output_chunk": (
        "gen_ai_client_operation_time_per_output_chunk_seconds"
    ),
}


def value(point: Any) -> float:
    return float(point.as_int if point.HasField("as_int") else point.as_double)


def latest(server: Collector, requests: int) -> dict[str, Any]:
    """The newest export's metrics by name, once it counts `requests` requests."""
    deadline = time.monotonic() + 15
    while True:
        exports: list[ExportMetricsServiceRequest] = server.metrics()
        if exports:
            [resource] = exports[-1].resource_metrics
            metrics = {m.name: m for sm in resource.scope_metrics for m in sm.metrics}
            counted = metrics.get("tokenweir.requests")
            if counted and sum(map(value, counted.sum.data_points)) >= requests:
                return metrics
        assert time.monotonic() < deadline, "no metrics export counted the requests"
        time.sleep(0.05)


def metrics_to(server: Collector, monkeypatch: pytest.MonkeyPatch) -> None:
    """OTLP metrics (no traces) to `server`, every 200 ms."""
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "200")


@pytest.fixture
def paced_url() -> Iterator[str]:
    """100 tokens/s: the stream's chunks come apart, so its gaps are measured, as a rule."""
    with serve(mockbackend.create_app(ttft_ms=0, tokens_per_second=100)) as url:
        yield url


def test_otlp_metrics_match_the_prometheus_page(
    paced_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = policy_file(paced_url, tmp_path, monkeypatch)
    with collector() as server:
        metrics_to(server, monkeypatch)
        with replicas(config, 1) as [(_, url)]:
            with openai.OpenAI(base_url=url + "/v1", api_key=ALPHA_KEY, max_retries=0) as client:
                messages = [{"role": "user", "content": "hi"}]
                list(client.chat.completions.create(
                    model="mock-llm", messages=messages, max_tokens=9, stream=True,  # type: ignore[arg-type]
                ))  # fmt: skip
                client.chat.completions.create(model="mock-llm", messages=messages, max_tokens=4)  # type: ignore[arg-type]
            page = httpx.get(url + "/metrics").text
            metrics = latest(server, requests=2)
    prometheus = {f.name: f for f in text_string_to_metric_families(page)}

    usage = metrics["gen_ai.client.token.usage"]
    assert usage.unit == "{token}"
    outputs = [
        p for p in usage.histogram.data_points
        if {a.key: a.value.string_value for a in p.attributes}["gen_ai.token.type"] == "output"
    ]  # fmt: skip
    assert sorted(p.sum for p in outputs) == [13.0]  # 9 + 4, one label set (chat, mock-llm, 2xx)
    [output] = outputs
    assert tuple(output.explicit_bounds) == semconv.TOKENS
    assert sum(output.bucket_counts) == output.count == 2
    attributes = {a.key: a.value.string_value for a in output.attributes}
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.provider.name"] == "openai"
    assert attributes["gen_ai.request.model"] == "mock-llm"
    assert attributes["tokenweir.tenant"] == "alpha"
    assert attributes["tokenweir.status_class"] == "2xx"
    assert usage.histogram.aggregation_temporality == 2  # cumulative

    for otel_name, prometheus_name in PAIRS.items():
        family = prometheus[prometheus_name]
        counts = [s.value for s in family.samples if s.name.endswith("_count")]
        sums = [s.value for s in family.samples if s.name.endswith("_sum")]
        # A family with no series yet is left out of the export, as /metrics shows it empty:
        # chunk gaps need two reads with text, and a loaded machine can read a stream at once.
        otel = metrics.get(otel_name)
        assert otel is not None or not counts, otel_name
        if otel is None:
            continue
        assert otel.unit == "s"
        points = otel.histogram.data_points
        assert sorted(p.count for p in points) == sorted(counts), otel_name
        assert sorted(p.sum for p in points) == pytest.approx(sorted(sums)), otel_name
    cache = metrics["tokenweir.cache.requests"]
    assert cache.sum.is_monotonic
    assert sum(map(value, cache.sum.data_points)) == 2


def test_the_ledgers_figures_go_out_without_a_scrape(
    backend_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ledger's counters were read only when /metrics was scraped: with OTLP alone they
    never went out (or went out as old as the last scrape)."""
    config = policy_file(backend_url, tmp_path, monkeypatch)
    config.write_text(config.read_text() + f"ledger: sqlite:///{tmp_path / 'ledger.db'}\n")
    with collector() as server:
        metrics_to(server, monkeypatch)
        with replicas(config, 1) as [(_, url)]:
            with openai.OpenAI(base_url=url + "/v1", api_key=ALPHA_KEY, max_retries=0) as client:
                client.chat.completions.create(
                    model="mock-llm", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )  # fmt: skip
            deadline = time.monotonic() + 30
            while True:  # the record is written within seconds, then exported
                written = latest(server, requests=1).get("tokenweir.ledger.records_written")
                if written is not None and sum(map(value, written.sum.data_points)) == 1:
                    break
                assert time.monotonic() < deadline, written
                time.sleep(0.05)


def test_every_family_goes_out_under_its_opentelemetry_name() -> None:
    """The broken-stream and ledger families went out under their Prometheus names
    (`tokenweir_ledger_records_written`, no unit) while the page said every series has an
    OpenTelemetry one."""
    metrics = GatewayMetrics()
    metrics.watch_ledger(lambda: LedgerStats(3, 2, 1, 0, 0, None))
    metrics.render()  # reads the ledger's counters
    families = list(metrics.collect())
    assert {f.name for f in families} <= set(NAMES)
    data = metrics_data(families, Resource.create({}), 0, 1)
    sent = {m.name: m.unit for rm in data.resource_metrics for sm in rm.scope_metrics
            for m in sm.metrics}  # fmt: skip
    assert sent["tokenweir.ledger.records_written"] == "{record}"
    assert all("." in name for name in sent), sorted(sent)  # none under its Prometheus name


def test_a_reloads_result_is_no_cache_result() -> None:
    """The reload counter's `result` label went out as the cache's attribute
    (`tokenweir.cache.result`), under its Prometheus name."""
    metrics = GatewayMetrics()
    metrics.policy_reloaded("refused")
    data = metrics_data(list(metrics.collect()), Resource.create({}), 0, 1)
    [reloads] = [m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
                 if m.name == "tokenweir.policy.reloads"]  # fmt: skip
    [point] = reloads.data.data_points
    assert point.attributes == {"tokenweir.reload.result": "refused"}
