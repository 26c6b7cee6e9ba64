"""Redis Sentinel failover under a real `tokenweir serve` on `storage: redis+sentinel://...`: the
primary is killed, the sentinel promotes its replica, and the gateway follows by itself: answers
throughout (`on_storage_error: open`); limits, budgets and the cache work on the new primary; no
ledger record is lost."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import redis

from proxy.tools.mock import backend as mockbackend
from tests.redis_sentinel import SERVICE, SentinelTopology, sentinel_topology
from tests.reliability.state import (
    AUTH,
    TENANT,
    ledger_records,
    policy_text,
    slots_held,
    tokens_reserved,
)
from tests.servers import replicas, serve

LONG = {"stream": True, "max_tokens": 4000, "mock_completion_tokens": 4000}


def _chat(question: str = "hi") -> dict[str, object]:
    """Temperature 0: the cache (mode exact) keeps only deterministic answers."""
    return {"model": "mock-llm", "messages": [{"role": "user", "content": question}],
            "max_tokens": 5, "temperature": 0}  # fmt: skip


def _wait_for(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.05)


def test_the_gateway_follows_a_sentinel_failover_by_itself(
    backend_url: str, tmp_path: Path
) -> None:
    with sentinel_topology() as topology:
        config = tmp_path / "policy.yaml"
        text = policy_text(backend_url, topology.url, max_concurrent=1, cache="{mode: exact}")
        config.write_text(text)
        with replicas(config, 1) as [(_, url)], httpx.Client(base_url=url, headers=AUTH) as http:
            sent = 0

            def ask(question: str = "hi") -> httpx.Response:
                nonlocal sent
                sent += 1
                return http.post("/v1/chat/completions", json=_chat(question))

            assert [ask(f"before {i}").status_code for i in range(5)] == [200] * 5
            old_primary = topology.primary_url()
            _wait_for(lambda: ledger_records(old_primary) == 5)
            # Replication is asynchronous: what the killed primary had not passed on is lost.
            _wait_for(lambda: ledger_records(topology.replica.url) == 5)

            topology.primary.kill()
            killed_s = time.monotonic()
            # While the sentinel decides, storage calls fail at once: open admits, no waiting.
            assert [ask(f"during {i}").status_code for i in range(5)] == [200] * 5
            assert time.monotonic() - killed_s < 2.5
            topology.wait_promoted()
            assert topology.primary_url() == topology.replica.url
            # The gateway finds the new primary by itself: storage answers again on /readyz.
            _wait_for(lambda: http.get("/readyz").status_code == 200, timeout_s=5)
            recovered_s = time.monotonic() - killed_s
            assert recovered_s < 8
            decisions = http.get("/readyz").json()["storage_failure_decisions"]

            # The cache on the new primary: a new question is stored, then answered from it.
            assert ask("after").headers["x-tokenweir-cache"] == "miss"
            assert ask("after").headers["x-tokenweir-cache"] == "hit"
            # Limits and budgets on the new primary: a stream holds the only slot and a
            # reservation; a second request meanwhile is refused.
            with http.stream("POST", "/v1/chat/completions", json=_chat() | LONG) as stream:
                lines = stream.iter_lines()  # kept: dropping it would close the stream
                next(lines)
                sent += 1
                assert slots_held(topology.replica.url) == 1
                assert tokens_reserved(topology.replica.url) > 4000
                refused = ask()
            assert refused.status_code == 429
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"
            # No storage call failed after the failover.
            ready = http.get("/readyz").json()
            assert ready["storage_failure_decisions"] == decisions

            # Every request is in the ledger: those buffered during the failover too.
            _wait_for(lambda: ledger_records(topology.replica.url) == sent)
            assert slots_held(topology.replica.url) == 0
            assert tokens_reserved(topology.replica.url) == 0


def _booked(redis_url: str) -> int:
    """The tokens the tenant's daily quota counts as used."""
    with redis.Redis.from_url(redis_url) as client:
        keys = list(client.scan_iter(f"tw:{{{TENANT}}}:q:tokens:d:*"))
        return sum(int(client.hget(key, "used") or 0) for key in keys)


def test_a_stream_across_a_sentinel_failover_is_booked_whole_on_its_quota(tmp_path: Path) -> None:
    """While the sentinel had no primary to name, the stream's usage checkpoints failed before
    reaching any Redis, and their tokens were kept as booked: the daily quota of the new
    primary lacked what the stream generated during the failover (about 150 of 800 here),
    though the ledger had it."""
    with (
        serve(mockbackend.create_app(ttft_ms=0, tokens_per_second=100)) as backend_url,
        sentinel_topology() as topology,
    ):
        config = tmp_path / "policy.yaml"
        config.write_text(policy_text(backend_url, topology.url))
        body = _chat() | {"stream": True, "max_tokens": 800, "mock_completion_tokens": 800}
        with replicas(config, 1) as [(_, url)], httpx.Client(base_url=url, headers=AUTH) as http:
            with http.stream("POST", "/v1/chat/completions", json=body) as stream:
                lines = stream.iter_lines()
                next(lines)
                # Kill just after a checkpoint reached the replica: none is on its way.
                _wait_for(lambda: _booked(topology.replica.url) > 0)
                first = _booked(topology.replica.url)
                _wait_for(lambda: _booked(topology.replica.url) > first)
                topology.primary.kill()
                topology.wait_promoted()
                assert sum(1 for _ in lines) > 0
            assert stream.status_code == 200
            _wait_for(lambda: ledger_records(topology.replica.url) > 0)
            usage = http.get("/api/usage", params={"since": "1d"}).json()["data"][0]
        assert usage["output_tokens"] == 800
        assert _booked(topology.replica.url) == usage["input_tokens"] + usage["output_tokens"]


def test_a_graceful_sentinel_failover_moves_every_write_to_the_new_primary(
    backend_url: str, tmp_path: Path
) -> None:
    """`SENTINEL FAILOVER` leaves the old primary up, and a primary until the sentinel turns
    it into a replica 8 s or more later: the gateway's open connections kept writing there,
    ledger records and quota bookings it then dropped (20 of 45 requests' records were left)."""
    with sentinel_topology() as topology:
        config = tmp_path / "policy.yaml"
        config.write_text(policy_text(backend_url, topology.url))
        with replicas(config, 1) as [(_, url)], httpx.Client(base_url=url, headers=AUTH) as http:
            assert [http.post("/v1/chat/completions", json=_chat()).status_code] == [200]
            _wait_for(lambda: ledger_records(topology.replica.url) == 1)
            with redis.Redis(port=topology.sentinel_port) as sentinel:
                sentinel.execute_command("SENTINEL", "FAILOVER", SERVICE)
            topology.wait_promoted()
            new_primary = topology.replica.url

            def written() -> int:
                """Records on the new primary, once this gateway has written all it holds."""
                _wait_for(lambda: http.get("/readyz").json()["ledger"]["buffered"] == 0)
                return ledger_records(new_primary)

            def on_the_new_primary() -> bool:
                before = written()
                assert http.post("/v1/chat/completions", json=_chat()).status_code == 200
                return written() > before

            # Well before the old primary becomes a replica (8 s or more).
            _wait_for(on_the_new_primary, timeout_s=5)
            before = written()
            for _ in range(5):
                assert http.post("/v1/chat/completions", json=_chat()).status_code == 200
            assert written() == before + 5
            assert tokens_reserved(new_primary) == 0


def test_a_graceful_sentinel_failover_under_load_loses_no_record_and_leaks_no_slot(
    backend_url: str, tmp_path: Path
) -> None:
    """Between the replica's promotion and the gateway's move to it (the sentinel names it
    about a second after promoting it; the gateway asked it once a second), the old primary
    took the gateway's writes and dropped them as it became a replica: about 2 s of traffic's
    ledger records were missing from /api/usage (100 of 3,100 in an audit run), and the slots
    released there stayed held on the new primary until their leases ended (60 s): with
    `max_concurrent` requests in flight then, every request was refused 429 for a minute; so
    did their quota reservations."""
    with sentinel_topology() as topology:
        config = tmp_path / "policy.yaml"
        config.write_text(policy_text(backend_url, topology.url, max_concurrent=2))
        with replicas(config, 1) as [(_, url)], httpx.Client(base_url=url, headers=AUTH) as http:
            answered = _across_a_graceful_failover(url, topology, senders=2)
            # Until the releases are sent again (two storage timeouts after the switch), the
            # slots released on the old primary are held on the new one: 429 meanwhile.
            assert set(answered) <= {200, 429}
            _wait_for(lambda: slots_held(topology.replica.url) == 0)
            _wait_for(lambda: tokens_reserved(topology.replica.url) == 0)
            _wait_for(lambda: http.get("/readyz").json()["ledger"]["buffered"] == 0)
            with contextlib.suppress(AssertionError):
                _wait_for(lambda: ledger_records(topology.replica.url) >= len(answered), 15)
            assert ledger_records(topology.replica.url) == len(answered)
            usage = http.get("/api/usage", params={"since": "1d"}).json()["data"][0]
            assert usage["requests"] == len(answered)


def _across_a_graceful_failover(url: str, topology: SentinelTopology, senders: int) -> list[int]:
    """`senders` clients, each one request after another, from before `SENTINEL FAILOVER`
    until the old primary has become a replica (and dropped what it took meanwhile); the
    statuses they got."""
    answered: list[int] = []
    stop = threading.Event()
    # A tenth of a second each (2,000 tokens/s): a slot is held at the promotion, most likely.
    body = _chat("load") | {"max_tokens": 200, "mock_completion_tokens": 200}

    def traffic() -> None:
        with httpx.Client(base_url=url, headers=AUTH, timeout=30) as own:
            while not stop.is_set():
                answered.append(own.post("/v1/chat/completions", json=body).status_code)

    threads = [threading.Thread(target=traffic) for _ in range(senders)]
    for thread in threads:
        thread.start()
    try:
        _wait_for(lambda: len(answered) >= 20)
        with redis.Redis(port=topology.sentinel_port) as sentinel:
            sentinel.execute_command("SENTINEL", "FAILOVER", SERVICE)
        topology.wait_promoted()
        _wait_for(lambda: _role(topology.primary.url) == "slave", timeout_s=30)
        time.sleep(1)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    return answered


def _role(redis_url: str) -> str:
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        return str(client.info("replication")["role"])
