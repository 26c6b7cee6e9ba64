"""A real `tokenweir serve` sends its spans over OTLP/HTTP to a collector configured by OTEL_*."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ALPHA_KEY
from tests.redis_server import wait_until
from tests.servers import free_port, replicas, wait_healthy
from tests.telemetry.collector import collector, policy_file


def test_spans_reach_the_collector_with_headers_gzip_and_a_retry(
    backend_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = policy_file(backend_url, tmp_path, monkeypatch)
    with collector(refuse=1) as server:
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-scope=ops,authorization=Bearer%20t0k")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "tw-under-test")
        with replicas(config, 1) as [(_, url)]:
            client = openai.OpenAI(base_url=url + "/v1", api_key=ALPHA_KEY, max_retries=0)
            with client:
                list(client.chat.completions.create(
                    model="mock-llm", messages=[{"role": "user", "content": "hi"}],
                    max_tokens=7, stream=True,
                ))  # fmt: skip
            deadline = time.monotonic() + 15
            while not server.spans():
                assert time.monotonic() < deadline, "no spans reached the collector"
                time.sleep(0.05)
    [(headers, request)] = server.spans()[:1]
    assert headers["x-scope"] == "ops"
    assert headers["authorization"] == "Bearer t0k"
    assert headers["content-type"] == "application/x-protobuf"
    [resource_spans] = request.resource_spans
    resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert resource["service.name"] == "tw-under-test"
    assert len(resource["service.instance.id"]) == 32  # one per process: workers stay apart
    spans = {s.name: s for ss in resource_spans.scope_spans for s in ss.spans}
    chat = spans["chat mock-llm"]
    attributes = {a.key: a.value for a in chat.attributes}
    assert attributes["gen_ai.operation.name"].string_value == "chat"
    assert attributes["gen_ai.usage.output_tokens"].int_value == 7
    assert attributes["gen_ai.request.stream"].bool_value is True
    assert spans["POST /chat/completions"].parent_span_id == chat.span_id


def _dropped(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {
        sample.labels["reason"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "tokenweir_spans_dropped"
        for sample in family.samples
    }


def test_spans_the_collector_refused_are_counted_on_metrics(
    backend_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collector that refuses every batch: the spans lost show on /metrics (they were in the
    log only, so losing every trace could not be alerted on)."""
    config = policy_file(backend_url, tmp_path, monkeypatch)
    with collector(refuse=1_000_000) as server:
        server.refused_with = 400  # not worth retrying: each batch is dropped at once
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        with replicas(config, 1) as [(_, url)]:
            assert _dropped(url) == {"queue_full": 0, "export_failed": 0}
            with openai.OpenAI(base_url=url + "/v1", api_key=ALPHA_KEY, max_retries=0) as client:
                for _ in range(3):
                    client.chat.completions.create(
                        model="mock-llm", messages=[{"role": "user", "content": "hi"}],
                        max_tokens=3,
                    )  # fmt: skip
            deadline = time.monotonic() + 15
            while (dropped := _dropped(url)) != {
                "queue_full": 0,
                "export_failed": server.refused_spans,
            } or server.refused_spans < 6:  # each request: its span and its backend call's
                assert time.monotonic() < deadline, (dropped, server.refused_spans)
                time.sleep(0.05)


def test_a_collector_login_in_the_endpoint_is_sent_and_never_logged(
    backend_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`http://user:token@collector:4318` as the endpoint: the login was not sent (the SDK's
    exporter sends it as Basic auth), so the collector refused every batch, and each refusal's
    warning printed the endpoint, token and all; a proxy's password too."""
    token = "collector-token-8d7c6b"
    config = policy_file(backend_url, tmp_path, monkeypatch)
    with collector(refuse=1) as server:
        server.refused_with = 401  # not retried: the batch is dropped with a warning
        endpoint = f"http://tw:{token}@127.0.0.1:{server.server_port}"
        unproxied = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
        env = {
            **unproxied, "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100",
            "HTTP_PROXY": f"socks5://proxy-user:{token}@127.0.0.1:1",  # not used: a warning
        }  # fmt: skip
        port = free_port()
        command = [sys.executable, "-m", "proxy", "serve", "--config", str(config)]
        process = subprocess.Popen(
            [*command, "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, process)
            with openai.OpenAI(base_url=url + "/v1", api_key=ALPHA_KEY, max_retries=0) as client:
                hi = [{"role": "user", "content": "hi"}]
                client.chat.completions.create(model="mock-llm", messages=hi)
                wait_until(lambda: bool(server.refused_at), "the first batch refused", 30)
                client.chat.completions.create(model="mock-llm", messages=hi)
                wait_until(lambda: bool(server.spans()), "a batch after it taken", 30)
        finally:
            process.terminate()
            stdout, stderr = process.communicate(timeout=30)
    login = "Basic " + base64.b64encode(f"tw:{token}".encode()).decode()
    assert next(headers.get("authorization") for headers, _ in server.spans()) == login
    assert b"dropped" in stderr  # the refused batch's warning
    assert b"socks5://" in stderr  # the proxy's
    assert token.encode() not in stdout + stderr
