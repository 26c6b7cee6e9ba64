"""The examples in examples/ run as written against a live gateway."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import DEFAULT_POLICY, create_app
from proxy.policy import load_policy
from tests.servers import serve

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.fixture(scope="module")
def demo_gateway(backend_url: str) -> Iterator[str]:
    """The gateway on the shipped demo policy, its backend pointed at the simulated one."""
    policy = load_policy(DEFAULT_POLICY.with_name("demo.yaml"), environ={})
    backends = tuple(b.model_copy(update={"url": backend_url + "/v1"}) for b in policy.backends)
    with serve(create_app(policy.model_copy(update={"backends": backends}))) as url:
        yield url


def test_openai_client_example(demo_gateway: str) -> None:
    env = {**os.environ, "TOKENWEIR_BASE_URL": demo_gateway + "/v1"}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "openai_client.py")],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "non-stream:" in done.stdout
    assert "completion_tokens=32" in done.stdout
    assert "models: ['mock-llm', 'mock-llm-small', 'mock-embed']" in done.stdout


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_example(demo_gateway: str) -> None:
    env = {**os.environ, "BASE": demo_gateway}
    done = subprocess.run(
        ["sh", str(EXAMPLES / "curl.sh")],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert '"object":"chat.completion"' in done.stdout
    assert "data: [DONE]" in done.stdout
    assert '"code":"invalid_api_key"' in done.stdout


def test_grafana_example_parses_and_queries_metrics_the_gateway_exports(
    demo_gateway: str,
) -> None:
    grafana = EXAMPLES / "grafana"
    compose = yaml.safe_load((grafana / "docker-compose.yml").read_text())
    assert {"tokenweir", "redis", "prometheus", "grafana"} <= set(compose["services"])
    for mounted in ("./prometheus.yml", "./provisioning", "./tokenweir-dashboard.json"):
        assert (grafana / mounted).exists(), mounted
    scrape = yaml.safe_load((grafana / "prometheus.yml").read_text())["scrape_configs"][0]
    assert scrape["static_configs"][0]["targets"] == ["tokenweir:8080"]
    for provisioning in (grafana / "provisioning").rglob("*.yml"):
        assert yaml.safe_load(provisioning.read_text())["apiVersion"] == 1
    load_policy(grafana / "policy.yaml", environ={"TOKENWEIR_API_KEY": "demo-key"})
    dashboard = json.loads((grafana / "tokenweir-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {m.removesuffix("_bucket") for e in exprs for m in re.findall(r"\b[a-z_]+(?={)", e)}
    httpx.post(demo_gateway + "/v1/chat/completions", json={})  # a 401, so series exist
    exported = {
        family.name for family in text_string_to_metric_families(
            httpx.get(demo_gateway + "/metrics").text
        )
    }  # fmt: skip
    exported |= {name + "_total" for name in exported}
    exported |= {f"{name}_{part}" for name in exported for part in ("sum", "count")}
    assert used - {"histogram_quantile", "label_values"} <= exported
