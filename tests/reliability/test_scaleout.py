"""Scale-out: `--workers 2` on one Redis is one gateway for limits; the compose and Kubernetes
examples parse and carry policies that `tokenweir policy check` accepts. (Docker and a cluster
are not available where the tests run: the examples are checked, not started.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import yaml

from tests.redis_server import private_redis
from tests.reliability.state import AUTH, policy_text
from tests.servers import free_port, wait_healthy

EXAMPLES = Path(__file__).parent.parent.parent / "examples"
CHAT = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def test_two_workers_on_one_redis_share_one_request_limit(backend_url: str, tmp_path: Path) -> None:
    with private_redis() as redis_url:
        config = tmp_path / "policy.yaml"
        config.write_text(policy_text(backend_url, redis_url, extra=", requests_per_minute: 6"))
        port = free_port()
        command = [sys.executable, "-m", "proxy", "serve", "--config", str(config)]
        command += ["--port", str(port), "--workers", "2", "--no-access-log"]
        server = subprocess.Popen(command, stderr=subprocess.PIPE)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, server)
            statuses = []
            for _ in range(12):  # a new connection each: the workers take turns accepting
                with httpx.Client(base_url=url, headers=AUTH) as http:
                    statuses.append(http.post("/v1/chat/completions", json=CHAT).status_code)
        finally:
            server.terminate()
            server.communicate(timeout=30)
    assert statuses.count(200) == 6  # one bucket of 6, not one per worker
    assert statuses.count(429) == 6


def _policy_check(text: str, tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(text)
    env = {**os.environ, "DEMO_TENANT_KEY": "tw-demo-key"}
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "policy", "check", str(policy)],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_compose_example_has_three_replicas_redis_a_balancer_and_a_valid_policy(
    tmp_path: Path,
) -> None:
    compose = yaml.safe_load((EXAMPLES / "compose" / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"redis", "backend", "tokenweir", "lb"}
    assert services["tokenweir"]["deploy"]["replicas"] == 3
    nginx = (EXAMPLES / "compose" / "nginx.conf").read_text()
    assert "server tokenweir:8080" in nginx
    assert "proxy_buffering off" in nginx  # streams pass through unbuffered
    _policy_check((EXAMPLES / "compose" / "policy.yaml").read_text(), tmp_path)


def test_k8s_example_has_probes_service_hpa_redis_and_a_valid_policy(tmp_path: Path) -> None:
    docs = [
        doc
        for name in ("tokenweir.yaml", "redis.yaml")
        for doc in yaml.safe_load_all((EXAMPLES / "k8s" / name).read_text())
    ]
    kinds = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    deployment = kinds[("Deployment", "tokenweir")]["spec"]
    container = deployment["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert deployment["template"]["spec"]["terminationGracePeriodSeconds"] > 30 + 5
    assert kinds[("HorizontalPodAutoscaler", "tokenweir")]["spec"]["minReplicas"] >= 2
    assert ("Service", "tokenweir") in kinds
    assert ("Service", "redis") in kinds
    policy = kinds[("ConfigMap", "tokenweir-policy")]["data"]["policy.yaml"]
    _policy_check(policy, tmp_path)
