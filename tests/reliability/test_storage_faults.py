"""Redis down at start, killed mid-stream and restarted, under a real `tokenweir serve`: the
tenant's open/closed policy holds, the ledger buffers and loses no record, and the gateway
recovers by itself."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.redis_server import RedisProcess
from tests.reliability.state import AUTH, ledger_records, policy_text, slots_held
from tests.servers import replicas

CHAT = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def _wait_for(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.1)


@pytest.mark.parametrize(("policy", "while_down"), [("open", 200), ("closed", 503)])
def test_redis_down_at_start_follows_the_policy_then_recovers(
    backend_url: str, tmp_path: Path, policy: str, while_down: int
) -> None:
    redis = RedisProcess()  # not started: the gateway starts without it
    try:
        config = tmp_path / "policy.yaml"
        text = policy_text(backend_url, redis.url, extra=f", on_storage_error: {policy}")
        config.write_text(text)
        with replicas(config, 1) as [(_, url)], httpx.Client(base_url=url, headers=AUTH) as http:
            down = [http.post("/v1/chat/completions", json=CHAT) for _ in range(3)]
            assert [a.status_code for a in down] == [while_down] * 3
            if while_down == 503:
                assert down[0].json()["error"]["code"] == "storage_unavailable"
                assert down[0].headers["retry-after"] == "1"
            redis.start()
            up = [http.post("/v1/chat/completions", json=CHAT) for _ in range(2)]
            assert [a.status_code for a in up] == [200, 200]
            _wait_for(lambda: http.get("/readyz").status_code == 200)
            # Every request is in the ledger, those answered while Redis was down included.
            _wait_for(lambda: ledger_records(redis.url) == 5)
            assert slots_held(redis.url) == 0
    finally:
        redis.close()


def test_redis_killed_mid_stream_and_restarted_loses_no_ledger_record(
    backend_url: str, tmp_path: Path
) -> None:
    redis = RedisProcess()
    redis.start()
    try:
        config = tmp_path / "policy.yaml"
        config.write_text(policy_text(backend_url, redis.url))
        with replicas(config, 1) as [(_, url)], httpx.Client(base_url=url, headers=AUTH) as http:
            body = {**CHAT, "stream": True, "max_tokens": 2000, "mock_completion_tokens": 2000}
            with http.stream("POST", "/v1/chat/completions", json=body) as answer:
                lines = answer.iter_lines()
                next(lines)
                redis.stop()  # mid-stream: the stream goes on, its settlement cannot
                rest = [line for line in lines if line]
            assert rest[-1] == "data: [DONE]"
            during = [http.post("/v1/chat/completions", json=CHAT) for _ in range(5)]
            assert [a.status_code for a in during] == [200] * 5  # on_storage_error: open
            redis.start()  # empty: what was written before the outage is gone with it
            _wait_for(lambda: ledger_records(redis.url) == 6)  # the stream and the five
            after = http.post("/v1/chat/completions", json=CHAT)
            assert after.status_code == 200
            _wait_for(lambda: ledger_records(redis.url) == 7)
            assert slots_held(redis.url) == 0
    finally:
        redis.close()
