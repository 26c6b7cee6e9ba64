"""docs/observability.md names what the gateway exports: every metric and label it names is on a
real gateway's `/metrics` after a request, every family there is named in it, its list of
OpenTelemetry names is the OTLP push's, and its request span attributes are the span's."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from proxy.telemetry.metrics import GatewayMetrics
from proxy.telemetry.otlpmetrics import ATTRIBUTES, NAMES
from proxy.telemetry.spanattrs import REPEATING_KEYS, VARYING_KEYS
from tests.servers import serve

PAGE = Path(__file__).resolve().parents[2] / "docs" / "observability.md"
KEY = "tw-docs-metrics"
_PROMETHEUS = re.compile(r"(?<![\w.])((?:tokenweir|gen_ai)_[a-z0-9_]*[a-z0-9])(?![\w*])")
# Shown only while tokenweir's own OTLP span export runs: checked on the metrics object below.
_OTLP_ONLY = {"tokenweir_spans_dropped_total"}


def stream_chat(url: str, key: str) -> None:
    """One streamed chat completion of mock-llm through the gateway at `url`, answered 200."""
    chat = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    answer = httpx.post(
        url + "/v1/chat/completions",
        json={**chat, "stream": True},
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text


def _exported(url: str) -> tuple[set[str], set[str]]:
    """The families on `/metrics` (as its `# TYPE` lines name them) and the labels of their
    samples."""
    text = httpx.get(url + "/metrics", timeout=30).text
    families = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    labels = {
        label
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        for label in sample.labels
    }
    return families, labels


def test_every_metric_the_page_names_is_exported_and_every_one_exported_is_named(
    backend_url: str, tmp_path: Path
) -> None:
    text = f"""
ledger: sqlite:///{tmp_path}/ledger.db
backends: [{{name: mock, url: "{backend_url}/v1", models: [mock-llm]}}]
models: {{mock-llm: {{price: {{input_per_1m: 1, output_per_1m: 2}}}}}}
tenants:
  t:
    api_keys: [{hash_key(KEY)}]
    models: [mock-llm]
    budget: {{tokens_per_day: 100000, usd_per_day: 5}}
"""
    policy = parse_policy(text, file="docs-metrics.yaml", environ={})
    with serve(create_app(policy)) as url:
        stream_chat(url, KEY)
        families, labels = _exported(url)
    named = set(_PROMETHEUS.findall(PAGE.read_text(encoding="utf-8")))
    missing = named - families - labels - _OTLP_ONLY
    assert not missing, f"docs/observability.md names what /metrics does not show: {missing}"
    unnamed = {f for f in families if not f.startswith("process_")} - named
    assert not unnamed, f"/metrics shows what docs/observability.md does not name: {unnamed}"


def test_the_lost_spans_counter_is_exported_under_its_documented_name() -> None:
    metrics = GatewayMetrics()
    metrics.watch_spans(lambda: {"queue_full": 0, "export_failed": 0})
    metrics.read_watched()
    families = set(re.findall(r"^# TYPE (\S+) ", generate_latest(metrics.registry).decode(), re.M))
    assert families >= _OTLP_ONLY


def _otlp_paragraph() -> str:
    text = PAGE.read_text(encoding="utf-8")
    start = text.index("goes out under its OpenTelemetry name")
    return text[start : text.index("Histograms carry", start)]


def test_the_otlp_names_the_page_lists_are_the_push_s() -> None:
    listed = re.findall(r"`((?:tokenweir|gen_ai)\.[a-z0-9_.]+|[._][a-z0-9_.]+)`", _otlp_paragraph())
    sent = {name for name, _ in NAMES.values()}
    known = sent | set(ATTRIBUTES.values()) | {"tokenweir.reload.result"}
    full = {name for name in listed if name[0] not in "._"}
    assert full <= known, f"listed but never sent: {full - known}"
    for name in sent - full:
        if name.startswith("gen_ai."):
            continue  # the GenAI histograms are listed by example ("...")
        shorthands = [part for part in listed if part[0] in "._" and name.endswith(part)]
        assert shorthands, f"{name} is sent by the OTLP push but not listed"


def test_the_request_span_attributes_the_page_lists_are_the_span_s() -> None:
    text = PAGE.read_text(encoding="utf-8")
    start = text.index("One span per request")
    paragraph = text[start : text.index("Child spans", start)]
    listed = {
        "tokenweir" + name if name.startswith(".") else name
        for name in re.findall(r"`(\.?[a-z_]+(?:\.[a-z_]+)*)`", paragraph)
        if "." in name
    }
    assert listed == set(REPEATING_KEYS) | set(VARYING_KEYS)
