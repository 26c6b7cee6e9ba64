"""A SQLite ledger's file deleted under a real `tokenweir serve`: the requests served after it
are in the file `tokenweir report` reads at that path, once the gateway has stopped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import orjson

from tests.redis_server import wait_until
from tests.reliability.state import AUTH, policy_text
from tests.servers import replicas

CHAT = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def _written(http: httpx.Client) -> int:
    return int(http.get("/readyz?backends=skip").json()["ledger"]["written"])


def test_requests_served_after_the_ledger_file_is_deleted_are_reported(
    backend_url: str, tmp_path: Path
) -> None:
    """They went to the deleted file: /metrics counted them written, the report never saw them."""
    database = tmp_path / "data" / "usage.db"
    database.parent.mkdir()
    ledger = f"sqlite:///{database}"
    config = tmp_path / "policy.yaml"
    config.write_text(
        policy_text(backend_url, "memory").replace(
            "storage: memory", f"storage: memory\nledger: {ledger}"
        )
    )
    with replicas(config, 1) as [(_, url)], httpx.Client(base_url=url, headers=AUTH) as http:
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
        wait_until(lambda: _written(http) == 1, "the first record written")
        database.unlink()
        after = [http.post("/v1/chat/completions", json=CHAT) for _ in range(3)]
        assert [a.status_code for a in after] == [200] * 3
        wait_until(lambda: _written(http) == 4, "the records written")
    report = subprocess.run(
        [sys.executable, "-m", "proxy", "report", "--ledger", ledger, "--format", "json"],
        capture_output=True, check=True, timeout=120,
    )  # fmt: skip
    assert orjson.loads(report.stdout)["total"]["requests"] == 3
