"""Scale-out: `--workers 2` on one Redis is one gateway for limits. (The compose and Kubernetes
examples are checked, and the compose stack started, in tests/deploy/.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from tests.redis_server import private_redis
from tests.reliability.state import AUTH, policy_text
from tests.servers import free_port, wait_healthy

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
