"""Redis up but refusing writes (full under noeviction, a read-only replica, a failed RDB save),
under a real `tokenweir serve`: `/readyz` says so, requests follow `on_storage_error`, and the
ledger keeps every record and writes it once Redis takes writes again, and a running stream's
usage is booked whole on its quota."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import orjson
import pytest
import redis

from proxy.policy.units import hash_key
from proxy.tools.mock import backend as mockbackend
from tests.redis_server import RedisProcess, wait_until
from tests.reliability.state import AUTH, TENANT, ledger_records, policy_text
from tests.servers import replicas, serve

ADMIN_KEY = "tw-refusals-admin"
CHAT = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def _full(client: redis.Redis) -> Callable[[], object]:
    client.config_set("maxmemory", "1")  # noeviction, the default: writes get OOM
    return lambda: client.config_set("maxmemory", "0")


def _replica(client: redis.Redis) -> Callable[[], object]:
    client.execute_command("REPLICAOF", "127.0.0.1", "1")  # a primary it never reaches
    return lambda: client.execute_command("REPLICAOF", "NO", "ONE")


def _save_failed(client: redis.Redis) -> Callable[[], object]:
    """A failed RDB save (stop-writes-on-bgsave-error, the default): writes, and PING, MISCONF."""
    workdir = client.config_get("dir")["dir"]
    client.config_set("save", "3600 1")
    client.config_set("dir", "/proc")  # no file can be made there, not even by root
    client.bgsave()
    wait_until(lambda: _refuses_writes(client), "the save to fail")
    return lambda: (client.config_set("dir", workdir), client.config_set("save", ""))


STATES = {"OOM": _full, "READONLY": _replica, "MISCONF": _save_failed}


@contextmanager
def _refusing(redis_url: str, state: str) -> Iterator[None]:
    with redis.Redis.from_url(redis_url) as client:
        undo = STATES[state](client)
        assert _refuses_writes(client)
        try:
            yield
        finally:
            undo()


def _refuses_writes(client: redis.Redis) -> bool:
    try:
        client.set("tw-test:probe", "1", px=1000)
    except redis.ResponseError:
        return True
    return False


@contextmanager
def _gateway(
    backend_url: str, tmp_path: Path, extra: str = ""
) -> Iterator[tuple[str, httpx.Client]]:
    """A gateway on a Redis of its own that a test may put into any of STATES."""
    redis_server = RedisProcess(["--enable-protected-configs", "yes"])  # MISCONF sets `dir`
    redis_server.start()
    try:
        config = tmp_path / "policy.yaml"
        text = policy_text(backend_url, redis_server.url, extra=extra)
        config.write_text(
            text.replace("tenants:", f"admin_keys: [{hash_key(ADMIN_KEY)}]\ntenants:")
        )
        with replicas(config, 1) as [(_, url)], httpx.Client(base_url=url, headers=AUTH) as http:
            yield redis_server.url, http
    finally:
        redis_server.close()


@pytest.mark.parametrize("state", list(STATES))
def test_redis_refusing_writes_is_not_ready_admits_open_and_loses_no_record(
    backend_url: str, tmp_path: Path, state: str
) -> None:
    """`/readyz` answered 200 ("storage": "ok") while a full or read-only Redis refused every
    reservation: a load balancer kept sending traffic that could not be limited or billed."""
    with _gateway(backend_url, tmp_path) as (redis_url, http):
        assert http.get("/readyz?backends=skip").status_code == 200
        with _refusing(redis_url, state):
            ready = http.get("/readyz?backends=skip")
            assert ready.status_code == 503
            assert state in ready.json()["storage"]
            during = [http.post("/v1/chat/completions", json=CHAT) for _ in range(3)]
            assert [a.status_code for a in during] == [200] * 3  # on_storage_error: open
        _wait_ready(http)
        wait_until(lambda: ledger_records(redis_url) == 3, "the ledger written")


def test_a_full_redis_under_closed_refuses_requests_and_readyz_alike(
    backend_url: str, tmp_path: Path
) -> None:
    """With `on_storage_error: closed` every request was a 503 while `/readyz` said 200."""
    with _gateway(backend_url, tmp_path, ", on_storage_error: closed") as (redis_url, http):
        with _refusing(redis_url, "OOM"):
            refused = http.post("/v1/chat/completions", json=CHAT)
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "storage_unavailable"
            # Redis answered: it refused, it was not "unreachable" (an operator chased the network)
            assert "storage refused the operation" in refused.json()["error"]["message"]
            assert http.get("/readyz?backends=skip").status_code == 503
        _wait_ready(http)
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200


def _wait_ready(http: httpx.Client) -> None:
    wait_until(lambda: http.get("/readyz?backends=skip").status_code == 200, "/readyz 200 again")


@pytest.mark.parametrize(
    ("state", "holder"), [("OOM", "tenant"), ("READONLY", "tenant"), ("OOM", "key")]
)
def test_a_stream_across_refused_writes_is_booked_whole_on_its_quota(
    tmp_path: Path, state: str, holder: str
) -> None:
    """A stream's usage is booked on its quotas once a second. The bookings Redis refused (it
    wrote nothing) were dropped, not taken up by the next: a stream of 2,005 tokens across
    2.5 s of a full Redis was booked at 1,604, and the tenant (or a runtime key, on its own
    quota) could overspend by the rest. The next booking now carries them."""
    body = {**CHAT, "max_tokens": 2000, "mock_completion_tokens": 2000, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with (
        serve(mockbackend.create_app(ttft_ms=0, tokens_per_second=200)) as slow_backend,
        _gateway(slow_backend, tmp_path) as (redis_url, http),
    ):
        headers, scope = _holder(http, holder)
        with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as answer:
            wait_until(lambda: _quota_used(redis_url, scope) > 0, "the stream's first booking")
            with _refusing(redis_url, state):
                refused = _refusals(redis_url, state) + 2  # bookings, one a second, of 10 s
                wait_until(lambda: _refusals(redis_url, state) >= refused, "two refused writes")
            frames = [line for line in answer.iter_lines() if line.startswith("data: {")]
        usage = orjson.loads(frames[-1].removeprefix("data: "))["usage"]
        assert usage["completion_tokens"] == 2000
        assert _quota_used(redis_url, scope) == usage["total_tokens"]


def _holder(http: httpx.Client, holder: str) -> tuple[dict[str, str], str]:
    """The headers of a request on the tenant's quota, or on a new runtime key's own (a daily
    token quota), and the key prefix of that quota."""
    if holder == "tenant":
        return AUTH, f"tw:{{{TENANT}}}"
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    created = http.post(
        "/admin/keys", json={"tenant": TENANT, "budget": {"tokens_per_day": 10**6}},
        headers=admin,
    ).json()  # fmt: skip
    return {"authorization": f"Bearer {created['key']}"}, f"tw:{{{TENANT}}}:key:{created['id']}"


def _refusals(redis_url: str, state: str) -> int:
    """How many calls Redis has refused with `state` (its error stats count a script's own)."""
    with redis.Redis.from_url(redis_url) as client:
        return int(client.info("errorstats").get(f"errorstat_{state}", {}).get("count", 0))


def _quota_used(redis_url: str, scope: str) -> int:
    """A daily token quota as booked (not what requests in flight hold)."""
    with redis.Redis.from_url(redis_url) as client:
        keys = client.scan_iter(f"{scope}:q:tokens:d:*")
        return sum(int(client.hget(key, "used") or 0) for key in keys)


@pytest.mark.parametrize(
    ("state", "holder"), [("READONLY", "tenant"), ("MISCONF", "tenant"), ("READONLY", "key")]
)
def test_a_request_that_ends_while_redis_refuses_is_booked_once_it_takes_writes(
    tmp_path: Path, state: str, holder: str
) -> None:
    """A request that settled while Redis refused writes lost its usage from the tenant's quota
    (the ledger had it), and its reservation held the quota until its lease ended. The settle
    is now kept, counted on /readyz and /metrics, and booked once Redis takes writes again.
    So is a runtime key's own quota. (Not OOM here: Redis lets a script go on writing once it
    has written, and the slot release sent before the settle in the same call does, so a full
    Redis takes this one.)"""
    body = {**CHAT, "max_tokens": 300, "mock_completion_tokens": 300}
    with (
        serve(mockbackend.create_app(ttft_ms=0, tokens_per_second=200)) as slow_backend,
        _gateway(slow_backend, tmp_path) as (redis_url, http),
        ThreadPoolExecutor(1) as pool,
    ):
        headers, scope = _holder(http, holder)
        answer = pool.submit(http.post, "/v1/chat/completions", json=body, headers=headers)
        wait_until(lambda: _quota_held(redis_url, scope) > 0, "the request's reservation")
        with _refusing(redis_url, state):
            usage = answer.result(timeout=30).json()["usage"]  # it ends while Redis refuses
            assert _quota_used(redis_url, scope) == 0
            during = http.get("/readyz?backends=skip").json()
        wait_until(lambda: _quota_used(redis_url, scope) == usage["total_tokens"], "the booking")
        assert _quota_held(redis_url, scope) == 0  # its reservation given back, not held 60 s
        kept = 2 if holder == "key" else 1  # a key's request settles its tenant's quota too
        assert during["quota_settles"]["pending"] == kept
        settles = http.get("/readyz?backends=skip").json()["quota_settles"]
        assert (settles["pending"], settles["booked_late"]) == (0, kept)
        metrics = http.get("/metrics").text
        assert (
            f'tokenweir_quota_settles_unbooked_total{{outcome="booked_late"}} {kept}.0' in metrics
        )
        time.sleep(1.0)  # sent again or not, it is booked once
        assert _quota_used(redis_url, scope) == usage["total_tokens"]


def _quota_held(redis_url: str, scope: str) -> int:
    """A daily token quota as requests in flight hold it."""
    with redis.Redis.from_url(redis_url) as client:
        keys = client.scan_iter(f"{scope}:q:tokens:d:*")
        return sum(int(client.hget(key, "reserved") or 0) for key in keys)


def test_a_gateway_stopped_while_redis_refuses_says_which_settles_it_could_not_book(
    tmp_path: Path,
) -> None:
    """SIGTERM with a settle kept: one last send, then what Redis still refused is logged."""
    body = {**CHAT, "max_tokens": 300, "mock_completion_tokens": 300}
    redis_server = RedisProcess()
    redis_server.start()
    try:
        config = tmp_path / "policy.yaml"
        with (
            serve(mockbackend.create_app(ttft_ms=0, tokens_per_second=200)) as slow_backend,
            ThreadPoolExecutor(1) as pool,
        ):
            config.write_text(policy_text(slow_backend, redis_server.url))
            with replicas(config, 1) as [(process, url)], httpx.Client(base_url=url) as http:
                answer = pool.submit(http.post, "/v1/chat/completions", json=body, headers=AUTH)
                wait_until(lambda: _quota_held(redis_server.url, f"tw:{{{TENANT}}}") > 0, "held")
                with _refusing(redis_server.url, "READONLY"):
                    assert answer.result(timeout=30).is_success
                    settles = http.get("/readyz?backends=skip").json()["quota_settles"]
                    assert settles["pending"] == 1
                    process.terminate()
                    _, stderr = process.communicate(timeout=30)
        assert b"shutdown: 1 quota settles could not be booked" in stderr
    finally:
        redis_server.close()
