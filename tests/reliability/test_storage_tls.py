"""`storage: rediss://...` under a real `tokenweir serve`: limits, quotas, the cache and the
ledger all work over TLS, and leave nothing held."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from tests.redis_server import tls_redis
from tests.reliability.state import AUTH, ledger_records, policy_text, slots_held, tokens_reserved
from tests.servers import replicas

CHAT = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def test_every_store_works_over_tls(backend_url: str, tmp_path: Path) -> None:
    with tls_redis(tmp_path) as (server, tls_url):
        config = tmp_path / "policy.yaml"
        config.write_text(policy_text(backend_url, tls_url, cache="{mode: exact}"))
        with replicas(config, 1) as [(_, url)], httpx.Client(base_url=url, headers=AUTH) as http:
            answers = [
                http.post("/v1/chat/completions", json=CHAT | {"temperature": 0}) for _ in range(3)
            ]
            assert [a.status_code for a in answers] == [200] * 3
            assert [a.headers["x-tokenweir-cache"] for a in answers] == ["miss", "hit", "hit"]
            assert http.get("/readyz").status_code == 200
            deadline = time.monotonic() + 10
            while ledger_records(server.url) < 3 and time.monotonic() < deadline:
                time.sleep(0.1)
        # Read back over the server's plain port: what the gateway wrote over TLS.
        assert ledger_records(server.url) == 3
        assert slots_held(server.url) == 0
        assert tokens_reserved(server.url) == 0
