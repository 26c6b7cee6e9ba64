"""Redis Cluster under real `tokenweir serve` processes (`storage: redis+cluster://...`): two
gateways share two tenants' limits, budgets, cache and ledger whose keys live on different
primaries; and a primary fails over to its replica, which the gateway follows by itself."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from redis.crc import key_slot

from proxy.ledger.rediskeys import TENANTS_KEY, checkpoints_key, stream_key, tag
from proxy.policy.units import hash_key
from proxy.tools.mock import backend as mockbackend
from tests.redis_cluster import ClusterProcesses, redis_cluster
from tests.redis_server import RedisProcess, wait_until
from tests.servers import replicas, serve
from tests.web.test_dashboard import logged_in

ALPHA, BETA, ADMIN = "tw-cluster-alpha", "tw-cluster-beta", "tw-cluster-admin"
LONG = {"stream": True, "max_tokens": 4000, "mock_completion_tokens": 4000}


def _policy(backend_url: str, storage: str, alpha_limits: str) -> str:
    """alpha: `alpha_limits`, a large budget, the exact cache; beta: a budget of a few requests.
    The backend's own limits are one more slot, shared by both."""
    return f"""
storage: {storage}
ledger: redis
admin_keys: [{hash_key(ADMIN)}]
backends:
  - {{name: mock, url: "{backend_url}/v1", models: [mock-llm], limits: {{max_concurrent: 32}}}}
models: {{mock-llm: {{}}}}
tenants:
  alpha:
    api_keys: [{hash_key(ALPHA)}]
    models: [mock-llm]
    budget: {{tokens_per_day: 1000000, max_output_tokens: 30000}}
    limits: {alpha_limits}
    cache: {{mode: exact}}
  beta:
    api_keys: [{hash_key(BETA)}]
    models: [mock-llm]
    budget: {{tokens_per_day: 80}}
    limits: {{max_concurrent: 4}}
"""


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _chat(url: str, key: str, question: str, **extra: object) -> httpx.Response:
    """Temperature 0: the exact cache keeps only deterministic answers."""
    body = {"model": "mock-llm", "messages": [{"role": "user", "content": question}],
            "max_tokens": 5, "temperature": 0, **extra}  # fmt: skip
    return httpx.post(url + "/v1/chat/completions", json=body, headers=_auth(key), timeout=10)


def _usage(url: str, key: str) -> dict[str | None, dict[str, object]]:
    answer = httpx.get(url + "/api/usage", params={"since": "1d"}, headers=_auth(key))
    assert answer.status_code == 200, answer.text
    return {row["tenant"]: row for row in answer.json()["data"]}


def _requests(url: str) -> Callable[[], dict[str | None, object]]:
    return lambda: {t: row["requests"] for t, row in _usage(url, ADMIN).items()}


def _beta_tokens_left(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    found = re.search(
        r'tokenweir_budget_remaining_tokens\{quota="tokens_per_day",tenant="beta"\} (\S+)', text
    )
    assert found is not None, "no budget gauge for beta"
    return float(found.group(1))


def test_two_gateways_share_limits_budgets_cache_and_ledger_on_a_cluster(
    backend_url: str,
    redis_cluster_server: ClusterProcesses,
    redis_cluster_url: str,
    tmp_path: Path,
) -> None:
    cluster = redis_cluster_server
    homes = {_home(cluster, key).port for key in ("tw:{alpha}", "tw:{beta}", TENANTS_KEY)}
    assert len(homes) == 3  # each tenant, and the ledger's list of tenants, on its own primary
    config = tmp_path / "policy.yaml"
    config.write_text(_policy(backend_url, redis_cluster_url, "{requests_per_minute: 6}"))
    with replicas(config, 2) as [(_, one), (_, two)]:
        # The cache: an answer stored through one gateway is a hit through the other.
        assert _chat(one, ALPHA, "same").headers["x-tokenweir-cache"] == "miss"
        assert _chat(two, ALPHA, "same").headers["x-tokenweir-cache"] == "hit"
        # One bucket of 6 requests a minute for alpha, whichever gateway answers (2 used).
        answers = [_chat((one, two)[i % 2], ALPHA, f"question {i}") for i in range(6)]
        assert [a.status_code for a in answers] == [200] * 4 + [429] * 2
        assert answers[-1].json()["error"]["code"] == "rate_limit_exceeded"

        # beta's daily budget runs out for both gateways at once (the same reservation each time).
        statuses = []
        while not statuses or statuses[-1] == 200:
            assert len(statuses) < 12, "beta's budget never ran out"
            answer = _chat((one, two)[len(statuses) % 2], BETA, "budget")
            statuses.append(answer.status_code)
        assert statuses.count(200) >= 2
        assert answer.json()["error"]["code"] == "insufficient_quota"
        assert _chat((one, two)[len(statuses) % 2], BETA, "budget").status_code == 429
        assert 0 <= _beta_tokens_left(one) == _beta_tokens_left(two) < 80

        # The ledger: every request of both gateways, read by either; the overview reads each
        # tenant's totals on its own primary.
        wanted = {"alpha": 8, "beta": len(statuses) + 1}
        wait_until(lambda: _requests(two)() == wanted, "the ledger", timeout_s=5)
        rows = _usage(one, ADMIN)
        assert (rows["alpha"]["rate_limited"], rows["alpha"]["cache_hits"]) == (2, 1)
        assert list(_usage(two, ALPHA)) == ["alpha"]
        with logged_in(one, ADMIN) as dashboard:
            overview = dashboard.get("/dashboard").text
        assert 'data-tenant="alpha"' in overview
        assert 'data-tenant="beta"' in overview
        assert httpx.get(one + "/readyz").status_code == 200
        assert httpx.get(two + "/readyz").status_code == 200


def _ledger_records(cluster: ClusterProcesses, tenant: str) -> int:
    with cluster.admin() as client:
        return int(client.xlen(stream_key(tag(tenant))))


def test_the_gateway_follows_a_cluster_failover_by_itself(backend_url: str, tmp_path: Path) -> None:
    with redis_cluster(primaries=3, replicas=1) as cluster:
        config = tmp_path / "policy.yaml"
        config.write_text(_policy(backend_url, cluster.url, "{max_concurrent: 1}"))
        with replicas(config, 1) as [(_, url)], httpx.Client(base_url=url) as http:
            sent = 0

            def ask(question: str, key: str = ALPHA) -> httpx.Response:
                nonlocal sent
                if key == ALPHA:
                    sent += 1
                return _chat(url, key, question)

            assert [ask(f"before {i}").status_code for i in range(5)] == [200] * 5
            wait_until(lambda: _ledger_records(cluster, "alpha") == 5, "the ledger")
            home = _home(cluster, "tw:{alpha}")
            with cluster.admin() as admin:  # replication is asynchronous: let it catch up
                node = admin.get_node("127.0.0.1", home.port)
                assert admin.execute_command("WAIT", 1, 2000, target_nodes=node) == 1

            home.kill()
            killed_s = time.monotonic()
            # Until a replica takes over, alpha's storage calls fail (open admits) at once: a
            # request makes several, each of which would take a second if it timed out.
            assert [ask(f"during {i}").status_code for i in range(3)] == [200] * 3
            # beta's primary stays up. Its first call after the kill may still fail while the
            # cluster client refreshes its slot map (seen on a loaded machine: admitted by the
            # open policy, counted): of three, at least one is reserved and settled (below).
            beta = [ask(f"during {i}", BETA).status_code for i in range(3)]
            assert beta[0] == 200
            assert set(beta) <= {200, 429}  # 429: its small budget ran out, so it was billed
            assert time.monotonic() - killed_s < 4 + 2  # two more requests than before
            wait_until(lambda: http.get("/readyz").status_code == 200, "readyz", timeout_s=10)
            recovered_s = time.monotonic() - killed_s
            # Every node's view catches up with the promotion (the gateway's did already).
            wait_until(lambda: _served_elsewhere(cluster, "tw:{alpha}", home), "the cluster view")
            decisions = http.get("/readyz").json()["storage_failure_decisions"]
            # beta's primary stayed up: its budget was reserved and settled meanwhile.
            assert _beta_tokens_left(url) < 80, decisions

            # The cache and the slot on the promoted replica.
            assert ask("after").headers["x-tokenweir-cache"] == "miss"
            assert ask("after").headers["x-tokenweir-cache"] == "hit"
            with http.stream(
                "POST", "/v1/chat/completions", headers=_auth(ALPHA),
                json={"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]} | LONG,
            ) as stream:  # fmt: skip
                lines = stream.iter_lines()  # kept: dropping it would close the stream
                next(lines)
                sent += 1
                refused = ask("while streaming")
            assert refused.status_code == 429
            assert http.get("/readyz").json()["storage_failure_decisions"] == decisions
            # Every alpha record is there: those buffered during the failover too.
            wait_until(lambda: _ledger_records(cluster, "alpha") == sent, "the ledger")
    assert recovered_s < 10


def test_ready_again_after_a_manual_cluster_failover(backend_url: str, tmp_path: Path) -> None:
    """`CLUSTER FAILOVER` leaves the old primary up, as a replica: the requests followed the
    MOVED at once, but /readyz kept probing the old primary as one (redis-py learns a single
    slot's move from MOVED and kept the node's old role) and answered 503 "You can't write
    against a read only replica" for as long as the gateway ran: a load balancer took every
    gateway out of service over a failover that had gone well."""
    with redis_cluster(primaries=3, replicas=1) as cluster:
        config = tmp_path / "policy.yaml"
        config.write_text(_policy(backend_url, cluster.url, "{max_concurrent: 1}"))
        with replicas(config, 1) as [(_, url)], httpx.Client(base_url=url) as http:
            assert [_chat(url, ALPHA, f"before {i}").status_code for i in range(3)] == [200] * 3
            assert http.get("/readyz").status_code == 200
            home = _home(cluster, "tw:{alpha}")
            cluster.fail_over_to(cluster.replica_of(home))
            wait_until(lambda: _served_elsewhere(cluster, "tw:{alpha}", home), "the failover")
            assert [_chat(url, ALPHA, f"after {i}").status_code for i in range(3)] == [200] * 3
            wait_until(lambda: http.get("/readyz").status_code == 200, "readyz", timeout_s=15)
            ready = http.get("/readyz").json()
            assert ready["storage"] == "ok"
            assert ready["storage_failure_decisions"] == {}
            wait_until(lambda: _ledger_records(cluster, "alpha") == 6, "the ledger")


def _home(cluster: ClusterProcesses, key: str) -> RedisProcess:
    node = cluster.primary_of(key)
    assert node is not None, f"no live node serves {key!r}"
    return node


def _served_elsewhere(cluster: ClusterProcesses, key: str, old: RedisProcess) -> bool:
    node = cluster.primary_of(key)
    return node is not None and node.port != old.port


def test_a_ledger_batch_refused_while_a_slot_migrates_is_counted_once(tmp_path: Path) -> None:
    """Resharding alpha's slot while a stream runs (so every key the ledger's script declares
    is still on the old node): the script wrote the batch's records and totals, then Redis
    refused an attribution cell it had not declared (a new user's, not on that node), and each
    retry of the batch counted it again: 3 requests showed as 4 or more in /api/usage."""
    long = {"stream": True, "max_tokens": 1000, "mock_completion_tokens": 1000}
    with (
        serve(mockbackend.create_app(ttft_ms=0, tokens_per_second=100)) as backend_url,
        redis_cluster() as cluster,
    ):
        config = tmp_path / "policy.yaml"
        config.write_text(_policy(backend_url, cluster.url, "{}"))
        with replicas(config, 1) as [(_, url)], httpx.Client(base_url=url, timeout=30) as http:
            assert _chat(url, ALPHA, "before").status_code == 200
            body = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]} | long
            with http.stream(
                "POST", "/v1/chat/completions", json=body, headers=_auth(ALPHA)
            ) as stream:
                lines = stream.iter_lines()  # kept: dropping it would close the stream
                next(lines)
                wait_until(lambda: _checkpointed(cluster, "alpha"), "a checkpoint")
                source = _home(cluster, "tw:{alpha}")
                target = next(node for node in cluster.nodes if node is not source)
                slot = key_slot(b"alpha")
                cluster.start_migrating(slot, source, target)
                failed = _ledger(url)["write_failures"]
                assert _chat(url, ALPHA, "during", user="someone new").status_code == 200
                wait_until(lambda: _ledger(url)["write_failures"] >= failed + 2, "retries")
                cluster.finish_migrating(slot, source, target)
                assert sum(1 for _ in lines) > 0
            wait_until(lambda: _requests(url)().get("alpha", 0) >= 3, "the ledger", timeout_s=15)
            wait_until(lambda: _ledger(url)["buffered"] == 0, "the ledger's buffer")
            usage = _usage(url, ADMIN)["alpha"]
    assert usage["requests"] == 3
    assert usage["output_tokens"] == 5 + 1000 + 5


def _checkpointed(cluster: ClusterProcesses, tenant: str) -> bool:
    with cluster.admin() as client:
        return bool(client.exists(checkpoints_key(tag(tenant))))


def _ledger(url: str) -> dict[str, int]:
    ledger: dict[str, int] = httpx.get(url + "/readyz").json()["ledger"]
    return ledger
