"""examples/compose started as written (3 replicas, Redis, nginx, the mock): requests spread over
the replicas, one rate limit and one quota across them, the dashboard's totals, a clean `down`."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from proxy.policy.units import hash_key
from tests.deploy.engine import REPO_ROOT, compose_command, docker, unique, wait_for
from tests.servers import free_port

pytestmark = pytest.mark.engine

COMPOSE_DIR = REPO_ROOT / "examples" / "compose"
ADMIN = {"authorization": "Bearer tw-admin-key"}
PACED_RPM = 120
METERED_TOKENS_PER_DAY = 3000


@dataclass(frozen=True, slots=True)
class Stack:
    url: str
    project: str
    command: tuple[str, ...]
    env: dict[str, str]

    def compose(self, *args: str, timeout_s: float = 300) -> str:
        done = subprocess.run(
            [*self.command, "-p", self.project, "-f", str(COMPOSE_DIR / "docker-compose.yml"),
             *args],
            capture_output=True, text=True, env=self.env, timeout=timeout_s, check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"compose {' '.join(args)}:\n{done.stderr}{done.stdout}"
        return done.stdout

    def containers(self, service: str | None = None, *, every: bool = False) -> list[str]:
        labels = [f"label=com.docker.compose.project={self.project}"]
        if service:
            labels.append(f"label=com.docker.compose.service={service}")
        filters = [arg for label in labels for arg in ("--filter", label)]
        return docker("ps", "-q", *(["-a"] if every else []), *filters).split()


def _test_policy(path: Path) -> None:
    """The example's policy as written, plus two tenants with tight limits to measure."""
    policy = yaml.safe_load((COMPOSE_DIR / "policy.yaml").read_text())
    policy["tenants"]["paced"] = {
        "api_keys": [hash_key("tw-paced-key")],
        "models": ["mock-llm"],
        "limits": {"requests_per_minute": PACED_RPM},
    }
    policy["tenants"]["metered"] = {
        "api_keys": [hash_key("tw-metered-key")],
        "models": ["mock-llm"],
        "budget": {"tokens_per_day": METERED_TOKENS_PER_DAY},
    }
    path.write_text(yaml.safe_dump(policy, allow_unicode=True))
    path.chmod(0o644)


@pytest.fixture(scope="module")
def stack(image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    policy = tmp_path_factory.mktemp("compose") / "policy.yaml"
    _test_policy(policy)
    port = free_port()
    env = {
        **os.environ, "TOKENWEIR_IMAGE": image, "LB_PORT": str(port),
        "TOKENWEIR_POLICY": str(policy),
    }  # fmt: skip
    for name in ("COMPOSE_PROFILES", "DEMO_TENANT_KEY", "ADMIN_KEY"):
        env.pop(name, None)  # the example's own defaults (.env, docker-compose.yml)
    stack = Stack(f"http://127.0.0.1:{port}", unique("twtest"), tuple(compose_command()), env)
    started = time.monotonic()
    try:
        stack.compose("up", "-d", "--no-build")
        replicas = stack.containers("tokenweir")
        assert len(replicas) == 3
        wait_for(
            lambda: all(_health(c) == "healthy" for c in replicas + stack.containers("backend")),
            "the replicas and the mock to be healthy", timeout_s=120,
        )  # fmt: skip
        print(f"\ncompose stack up and healthy in {time.monotonic() - started:.0f} s")
        yield stack
    finally:
        stack.compose("down", "-v", "--remove-orphans", timeout_s=180)


def _health(name: str) -> str:
    return docker("inspect", "--format", "{{.State.Health.Status}}", name, check=False)


def _chat(http: httpx.Client, key: str, max_tokens: int = 1) -> httpx.Response:
    body = {
        "model": "mock-llm", "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "how many replicas answer me?"}],
    }  # fmt: skip
    return http.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})


def _served_by_each(stack: Stack, tenant: str) -> list[int]:
    return list(_served_by(stack, tenant).values())


def _served_by(stack: Stack, tenant: str) -> dict[str, int]:
    """Requests of `tenant` each replica answered, from its own /metrics (read inside it)."""
    counts = {}
    for replica in stack.containers("tokenweir"):
        text = docker(
            "exec", replica, "python", "-c",
            "import urllib.request; print(urllib.request.urlopen("
            "'http://127.0.0.1:8080/metrics').read().decode())",
        )  # fmt: skip
        counts[replica] = int(
            sum(
                sample.value
                for family in text_string_to_metric_families(text)
                if family.name == "tokenweir_requests"
                for sample in family.samples
                if sample.labels.get("tenant") == tenant
            )
        )
    return counts


def _usage(stack: Stack, tenant: str) -> dict[str, int]:
    answer = httpx.get(f"{stack.url}/api/usage", params={"tenant": tenant}, headers=ADMIN)
    assert answer.status_code == 200, answer.text
    (row,) = answer.json()["data"]
    return row  # type: ignore[no-any-return]


def test_the_stack_streams_through_nginx(stack: Stack) -> None:
    body = {"model": "mock-llm", "max_tokens": 16, "stream": True,
            "messages": [{"role": "user", "content": "stream please"}]}  # fmt: skip
    with httpx.stream(
        "POST", stack.url + "/v1/chat/completions", json=body,
        headers={"authorization": "Bearer tw-demo-key"},
    ) as answer:  # fmt: skip
        assert answer.headers["content-type"].startswith("text/event-stream")
        events = [line for line in answer.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert len(events) >= 16  # one event per token, not one buffered blob


def test_one_rate_limit_holds_across_three_replicas_and_requests_spread_over_them(
    stack: Stack,
) -> None:
    sent = 2 * PACED_RPM
    with (
        httpx.Client(base_url=stack.url, timeout=30) as http,
        ThreadPoolExecutor(12) as pool,
    ):
        started = time.monotonic()
        statuses = list(pool.map(lambda _: _chat(http, "tw-paced-key").status_code, range(sent)))
        elapsed_s = time.monotonic() - started
    admitted = statuses.count(200)
    assert statuses.count(429) == sent - admitted
    # A bucket of PACED_RPM refilled at PACED_RPM per minute while the burst lasted; one bucket
    # per replica would have admitted all of them.
    allowance = PACED_RPM + PACED_RPM * elapsed_s / 60
    print(f"\nadmitted {admitted} of {sent} in {elapsed_s:.1f} s; allowance {allowance:.1f}")
    assert PACED_RPM * 0.99 <= admitted <= allowance * 1.01
    per_replica = _served_by_each(stack, "paced")
    assert sum(per_replica) == sent
    assert min(per_replica) >= sent / 3 * 0.5, per_replica  # round robin, not one replica


@dataclass(frozen=True, slots=True)
class Burst:
    served: list[dict[str, int]]
    refused: int
    row: dict[str, int]


@pytest.fixture(scope="module")
def metered_burst(stack: Stack) -> Burst:
    """80 requests of the metered tenant, 12 at a time, over the 3 replicas; and its ledger row
    once the ledger holds all of them."""
    with (
        httpx.Client(base_url=stack.url, timeout=30) as http,
        ThreadPoolExecutor(12) as pool,
    ):
        answers = list(pool.map(lambda _: _chat(http, "tw-metered-key", 64), range(80)))
    served = [a.json()["usage"] for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code == 429]
    assert len(served) + len(refused) == len(answers)
    # a quota held only by requests in flight is rate_limit_exceeded (retry in a second)
    assert {a.json()["error"]["code"] for a in refused} <= {
        "insufficient_quota",
        "rate_limit_exceeded",
    }
    wait_for(
        lambda: _usage(stack, "metered")["requests"] == len(answers),
        "the ledger to hold every request", timeout_s=30,
    )  # fmt: skip
    return Burst(served, len(refused), _usage(stack, "metered"))


def test_a_quota_is_never_overspent_across_replicas_and_the_dashboard_shows_the_sum(
    stack: Stack, metered_burst: Burst
) -> None:
    served, row = metered_burst.served, metered_burst.row
    assert served
    assert metered_burst.refused
    spent = sum(u["prompt_tokens"] + u["completion_tokens"] for u in served)
    print(f"\nserved {len(served)} of 80, {spent} of {METERED_TOKENS_PER_DAY} tokens")
    assert spent <= METERED_TOKENS_PER_DAY
    assert row["requests"] == 80
    assert row["rate_limited"] == metered_burst.refused
    assert row["output_tokens"] == sum(u["completion_tokens"] for u in served)
    assert sum(_served_by_each(stack, "metered")) == 80


def test_the_dashboard_bills_only_what_the_backend_served(metered_burst: Burst) -> None:
    served, row = metered_burst.served, metered_burst.row
    assert row["input_tokens"] == sum(u["prompt_tokens"] for u in served)
    price_nusd = {"input": 100, "output": 400}  # policy.yaml: 0.10 and 0.40 USD per 1M tokens
    cost_nusd = sum(
        u["prompt_tokens"] * price_nusd["input"] + u["completion_tokens"] * price_nusd["output"]
        for u in served
    )
    assert row["cost_nusd"] == cost_nusd


def test_nginx_follows_replicas_added_and_removed(stack: Stack) -> None:
    stack.compose("up", "-d", "--no-build", "--no-recreate", "--scale", "tokenweir=4")
    replicas = stack.containers("tokenweir")
    assert len(replicas) == 4
    wait_for(lambda: all(_health(c) == "healthy" for c in replicas), "4 healthy replicas", 120)
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        # nginx asks Docker's DNS again once its answer is 5 s old: the new replica gets
        # requests without nginx being restarted or reloaded.
        def new_one_serves() -> bool:
            assert _chat(http, "tw-demo-key").status_code == 200
            return min(_served_by(stack, "demo").values()) > 0

        wait_for(new_one_serves, "the added replica to get requests", timeout_s=60)
        stack.compose("up", "-d", "--no-build", "--no-recreate", "--scale", "tokenweir=3")
        assert len(stack.containers("tokenweir")) == 3
        # Within those 5 s nginx may still pick the removed replica's address: it cannot
        # connect, so it passes the request on (proxy_next_upstream error timeout).
        statuses = [_chat(http, "tw-demo-key").status_code for _ in range(30)]
    assert statuses == [200] * 30


def test_a_refused_key_is_logged_with_the_clients_address_not_nginxs(stack: Stack) -> None:
    """nginx sent X-Forwarded-For, but the replicas did not believe it: every refused key was
    logged as coming from nginx, whoever tried it. A client's own X-Forwarded-For must not
    name the address either."""
    (lb,) = stack.containers("lb")
    networks = "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}"
    lb_ips = set(docker("inspect", "--format", networks, lb).split())
    spoofed = "203.0.113.7"
    answer = httpx.get(
        f"{stack.url}/api/usage",
        headers={"authorization": "Bearer tw-wrong-key", "x-forwarded-for": spoofed},
    )  # fmt: skip
    assert answer.status_code == 401

    def logged() -> list[str]:
        lines = [
            line
            for replica in stack.containers("tokenweir")
            for line in subprocess.run(
                ["docker", "logs", replica], capture_output=True, text=True, check=False
            ).stderr.splitlines()  # the server log: stderr (stdout: access lines)
            if "/api/usage from " in line
        ]
        return lines

    wait_for(lambda: bool(logged()), "the refused key's warning")
    line = logged()[-1]
    address = line.split("/api/usage from ", 1)[1].split()[0].rstrip(",.:;")
    assert address not in lb_ips, line
    assert address != spoofed, line


def test_down_leaves_nothing_running(stack: Stack) -> None:
    assert len(stack.containers(every=True)) == 6  # redis, backend, 3 replicas, nginx
    stack.compose("down", "-v", "--remove-orphans", timeout_s=180)
    assert stack.containers(every=True) == []
    label = f"label=com.docker.compose.project={stack.project}"
    assert docker("network", "ls", "-q", "--filter", label) == ""
    assert docker("volume", "ls", "-q", "--filter", label) == ""
