"""Redis down at start, killed mid-stream, restarted and slow, under a real `tokenweir serve`: the
tenant's open/closed policy holds, a slow Redis costs at most the storage timeout per call, the
ledger buffers and loses no record, and the gateway recovers by itself."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.tools.mock import backend as mockbackend
from tests.redis_server import RedisProcess, frozen
from tests.reliability.state import AUTH, day_quota, ledger_records, policy_text, slots_held
from tests.servers import replicas, serve

CHAT = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
# What each Redis call of the limit and quota stores may take (RedisStore, RedisLimitStore
# `timeout_s`): not a policy key.
STORAGE_TIMEOUT_S = 1.0


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


def test_redis_restarted_after_a_streams_checkpoint_counts_the_request_once(
    tmp_path: Path,
) -> None:
    """Redis restarts (empty) after a running stream's checkpoint reached it: the stream's final
    record supersedes a checkpoint Redis no longer holds. /api/usage showed the request not at
    all (requests 0) with its input tokens below zero; it shows it once, whole."""
    redis = RedisProcess()
    redis.start()
    config = tmp_path / "policy.yaml"
    try:
        with serve(mockbackend.create_app(ttft_ms=0, tokens_per_second=200)) as backend_url:
            config.write_text(policy_text(backend_url, redis.url))
            with replicas(config, 1) as [(_, url)]:
                total = _usage_after_a_restart_mid_stream(url, redis)
        assert (total["requests"], total["output_tokens"]) == (1, 1000)
        assert total["input_tokens"] > 0
    finally:
        redis.close()


def _usage_after_a_restart_mid_stream(url: str, redis: RedisProcess) -> dict[str, Any]:
    """Stream 1,000 tokens (5 s at 200/s), restarting Redis once the stream's first checkpoint
    is in its ledger; then the tenant's total on /api/usage once the final record is written."""
    body = {**CHAT, "stream": True, "max_tokens": 1000, "mock_completion_tokens": 1000}
    with httpx.Client(base_url=url, headers=AUTH, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as answer:
            lines = answer.iter_lines()
            next(lines)
            _wait_for(lambda: ledger_records(redis.url) == 1)  # the checkpoint
            redis.stop()
            redis.start()
            assert [line for line in lines if line][-1] == "data: [DONE]"
        _wait_for(lambda: ledger_records(redis.url) == 1)  # the final record
        total: dict[str, Any] = http.get("/api/usage").json()["total"]
    return total


@pytest.mark.parametrize(("policy", "while_slow"), [("open", 200), ("closed", 503)])
def test_slow_redis_costs_at_most_the_storage_timeout_per_call_then_recovers(
    backend_url: str, tmp_path: Path, policy: str, while_slow: int
) -> None:
    redis = RedisProcess()
    redis.start()
    try:
        config = tmp_path / "policy.yaml"
        extra = f", on_storage_error: {policy}, lease_ttl: 1s"
        config.write_text(policy_text(backend_url, redis.url, extra=extra))
        with replicas(config, 1) as [(_, url)], httpx.Client(base_url=url, headers=AUTH) as http:
            assert _admitted(http)
            with frozen(redis.url, 8):  # far longer than the waits below
                not_ready = http.get("/readyz")
                began = time.monotonic()
                slow = http.post("/v1/chat/completions", json=CHAT)
                waited_s = time.monotonic() - began
            assert not_ready.status_code == 503
            assert "Timeout" in not_ready.json()["storage"]
            assert slow.status_code == while_slow
            if policy == "open":  # the quota and the rate limit, one call: it waits, both admit
                assert STORAGE_TIMEOUT_S - 0.1 < waited_s < STORAGE_TIMEOUT_S + 2.5
                decisions = {"quota:open": 1, "rate_limit:open": 1}
            else:  # the quota's call waits, then refuses: nothing else is tried
                assert slow.json()["error"]["code"] == "storage_unavailable"
                assert slow.headers["retry-after"] == "1"
                assert STORAGE_TIMEOUT_S - 0.1 < waited_s < STORAGE_TIMEOUT_S + 2.5
                decisions = {"quota:closed": 1}
            # Fast again: the same gateway, no restart, admits with no storage decision (the
            # decisions below are exactly the slow call's: no further call timed out).
            assert _admitted(http)
            ready = http.get("/readyz")
            assert ready.status_code == 200
            assert ready.json()["storage_failure_decisions"] == decisions
            _wait_for(lambda: ledger_records(redis.url) == 3)
            # A call that timed out may still run once Redis catches up: the slot it takes is
            # held by nobody until its lease (lease_ttl) ends and an admission clears it.
            _wait_for(lambda: slots_held(redis.url) == 0 or not _admitted(http))
            assert slots_held(redis.url) == 0
    finally:
        redis.close()


def test_an_answer_settling_while_redis_is_slow_is_whole_and_ends_late(
    backend_url: str, tmp_path: Path
) -> None:
    """Settling runs before an answer's last message, which carries a stream's [DONE]: a slow
    Redis delays [DONE] (two calls, quota and slot, sent together and cut at the storage
    timeout), not the tokens before it."""
    redis = RedisProcess()
    redis.start()
    try:
        config = tmp_path / "policy.yaml"
        config.write_text(policy_text(backend_url, redis.url, extra=", lease_ttl: 1s"))
        with replicas(config, 1) as [(_, url)], httpx.Client(base_url=url, headers=AUTH) as http:
            body = {**CHAT, "stream": True, "max_tokens": 500, "mock_completion_tokens": 500}
            with http.stream("POST", "/v1/chat/completions", json=body, timeout=10) as answer:
                lines = answer.iter_lines()
                next(lines)
                began_s = time.monotonic()
                with frozen(redis.url, 4):
                    events = [line for line in itertools.takewhile(_not_done, lines) if line]
                    done_s = time.monotonic()
                    assert not [line for line in lines if line]  # the end of the answer
                    ended_after_done_s = time.monotonic() - done_s
            assert len(events) >= 499
            assert '"finish_reason":"' in events[-1]
            assert ended_after_done_s < 0.9 * STORAGE_TIMEOUT_S  # no third call waited
            waited_for_done_s = done_s - began_s
            # The two calls wait at once: one timeout, where one after the other took two.
            assert STORAGE_TIMEOUT_S - 0.1 < waited_for_done_s < 1.9 * STORAGE_TIMEOUT_S
            _wait_for(lambda: ledger_records(redis.url) == 1)
            _wait_for(lambda: slots_held(redis.url) == 0 or not _admitted(http))
            assert slots_held(redis.url) == 0
    finally:
        redis.close()


def _not_done(line: str) -> bool:
    return line != "data: [DONE]"


def _admitted(http: httpx.Client) -> bool:
    return http.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_a_request_that_ends_while_redis_is_down_is_booked_when_it_is_back(
    tmp_path: Path,
) -> None:
    """A request that ended while Redis was down (killed; it keeps its data on disk) lost its
    usage from the tenant's quota, and its reservation held the quota for its 60 s lease after
    Redis came back. Its settle, which never reached Redis, is now sent again and booked."""
    redis = RedisProcess(["--appendonly", "yes", "--appendfsync", "always"])
    redis.start()
    config = tmp_path / "policy.yaml"
    body = {**CHAT, "max_tokens": 300, "mock_completion_tokens": 300}
    try:
        with (
            serve(mockbackend.create_app(ttft_ms=0, tokens_per_second=200)) as backend_url,
            ThreadPoolExecutor(1) as pool,
        ):
            config.write_text(policy_text(backend_url, redis.url))
            with (
                replicas(config, 1) as [(_, url)],
                httpx.Client(base_url=url, headers=AUTH) as http,
            ):
                answer = pool.submit(http.post, "/v1/chat/completions", json=body)
                _wait_for(lambda: day_quota(redis.url)[1] > 0)  # reserved
                redis.kill()
                usage = answer.result(timeout=30).json()["usage"]
                redis.start()
                _wait_for(lambda: day_quota(redis.url) == (usage["total_tokens"], 0))
                settles = http.get("/readyz?backends=skip").json()["quota_settles"]
        assert (settles["pending"], settles["booked_late"], settles["uncertain"]) == (0, 1, 0)
    finally:
        redis.close()


def test_a_request_that_ends_while_redis_is_down_frees_its_slot_when_it_is_back(
    tmp_path: Path,
) -> None:
    """A request that ended while Redis was down (it keeps its data on disk) kept its
    concurrency slot until its lease ran out: a tenant at max_concurrent was refused 429 for
    the rest of the lease (here 5 minutes) after Redis came back. The release is sent again."""
    redis = RedisProcess(["--appendonly", "yes", "--appendfsync", "always"])
    redis.start()
    config = tmp_path / "policy.yaml"
    body = {**CHAT, "stream": True, "max_tokens": 300, "mock_completion_tokens": 300}
    try:
        with serve(mockbackend.create_app(ttft_ms=0, tokens_per_second=200)) as backend_url:
            policy = policy_text(backend_url, redis.url, max_concurrent=1, extra=", lease_ttl: 5m")
            config.write_text(policy)
            with (
                replicas(config, 1) as [(_, url)],
                httpx.Client(base_url=url, headers=AUTH, timeout=30) as http,
            ):
                with http.stream("POST", "/v1/chat/completions", json=body) as stream:
                    lines = stream.iter_lines()
                    next(lines)  # admitted: its slot is taken
                    assert slots_held(redis.url) == 1
                    redis.stop()
                    assert list(itertools.takewhile(_not_done, lines))  # ends while Redis is down
                redis.start()
                _wait_for(lambda: slots_held(redis.url) == 0, timeout_s=30)
                assert _admitted(http)
    finally:
        redis.close()


def test_a_true_up_redis_missed_is_sent_again_when_it_is_back(tmp_path: Path) -> None:
    """A request that ended while Redis was down (it keeps its data on disk) reserved 950
    tokens of a 1,000 tokens_per_minute bucket and used a few: its true-up was only logged, so
    the bucket kept the whole reservation and the next such request was refused 429 for about a
    minute after Redis came back. The true-up, which never reached Redis, is sent again, and
    counted on /readyz and /metrics (it was in the log only)."""
    redis = RedisProcess(["--appendonly", "yes", "--appendfsync", "always"])
    redis.start()
    config = tmp_path / "policy.yaml"
    big = {**CHAT, "max_tokens": 950, "mock_completion_tokens": 5}
    try:
        with serve(mockbackend.create_app(ttft_ms=0, tokens_per_second=2)) as backend_url:
            policy = policy_text(backend_url, redis.url)
            config.write_text(
                policy.replace("tokens_per_minute: 100000000", "tokens_per_minute: 1000")
            )
            with (
                replicas(config, 1) as [(_, url)],
                httpx.Client(base_url=url, headers=AUTH, timeout=30) as http,
            ):
                with http.stream(
                    "POST", "/v1/chat/completions", json={**big, "stream": True}
                ) as stream:
                    lines = stream.iter_lines()
                    next(lines)  # admitted: its 950 tokens are reserved
                    redis.stop()
                    assert list(itertools.takewhile(_not_done, lines))  # ends while Redis is down
                redis.start()
                _wait_for(
                    lambda: http.post("/v1/chat/completions", json=big).status_code == 200,
                    timeout_s=20,
                )
                true_ups = http.get("/readyz?backends=skip").json()["token_true_ups"]
                metrics = http.get("/metrics").text
        assert true_ups["pending"] == 0
        assert true_ups["trued_late"] >= 1
        late = true_ups["trued_late"]
        assert f'tokenweir_token_true_ups_missed_total{{outcome="trued_late"}} {late}.0' in metrics
        assert "tokenweir_token_true_ups_pending 0.0" in metrics
    finally:
        redis.close()
