"""Chaos: seeded random traffic through a real `tokenweir serve --workers 2` on a private Redis
that restarts mid-way, in front of the mock backend, a raw backend that counts its tokens and a
backend that refuses connections. Clients leave at random points; backends fail, cut streams and
stall past timeouts; small limits refuse some requests; the cache answers others. Once it is
quiet, what a user relies on holds (tests/reliability/chaoscheck.py)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from proxy.policy.units import hash_key
from tests.redis_server import RedisProcess
from tests.reliability import chaoscheck
from tests.reliability.chaosnet import RawCounts, Sent, raw_backend, send
from tests.servers import free_port, replicas, wait_healthy

SEEDS = (7, 2026)
REQUESTS = 220
AT_ONCE = 12
RESTART_AT = int(
    __import__("os").environ.get("CHAOS_RESTART_AT", "90")
)  # the request after which Redis is stopped, and started again a moment later
ADMIN, ROOMY, TIGHT = "tw-chaos-admin", "tw-chaos-roomy", "tw-chaos-tight"
PROMPTS = ("hello", "what is a weir", "tell me about tokens", "name a river")
DAILY_TOKENS = 6000  # the tight tenant's quota


@dataclass
class Rig:
    url: str
    port: int
    redis: RedisProcess
    mock_url: str
    raw: RawCounts


def _policy(redis_url: str, mock_url: str, raw_url: str) -> str:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: a refused connection
    return f"""
storage: {redis_url}
ledger: redis
admin_keys: [{hash_key(ADMIN)}]
upstream:
  {{connect_timeout: 1s, read_timeout: 1s, probe_interval: 0, circuit: {{failures: 100000}}}}
backends:
  - {{name: mock, url: "{mock_url}/v1", models: [mock-llm]}}
  - {{name: raw, url: "{raw_url}/v1", models: [raw-llm]}}
  - {{name: dead, url: "{dead}/v1", models: [dead-llm]}}
models:
  {{mock-llm: {{max_attempts: 1}}, raw-llm: {{max_attempts: 1}}, dead-llm: {{max_attempts: 1}}}}
tenants:
  roomy:
    api_keys: [{hash_key(ROOMY)}]
    models: [mock-llm, raw-llm, dead-llm]
    budget: {{tokens_per_day: 100000000}}
    limits: {{max_concurrent: 8}}
    cache: {{mode: exact}}
  tight:
    api_keys: [{hash_key(TIGHT)}]
    models: [mock-llm, raw-llm]
    budget: {{tokens_per_day: {DAILY_TOKENS}, max_output_tokens: 100}}
    limits: {{requests_per_minute: 40, tokens_per_minute: 3000, max_concurrent: 2}}
"""


@contextlib.contextmanager
def _mock_backend() -> Iterator[str]:
    """`tokenweir mock-backend`, quick: 2,000 tokens/s, no TTFT."""
    port = free_port()
    command = [sys.executable, "-m", "proxy", "mock-backend", "--port", str(port)]
    process = subprocess.Popen(
        [*command, "--ttft-ms", "0", "--tokens-per-second", "2000"], stderr=subprocess.PIPE
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, path="/v1/models")
        yield url
    finally:
        process.terminate()
        process.communicate(timeout=30)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    # Persistent (AOF, fsync always), as a Redis kept across restarts is: a restart loses nothing.
    redis = RedisProcess(["--appendonly", "yes", "--appendfsync", "always"])
    redis.start()
    config = tmp_path_factory.mktemp("chaos") / "policy.yaml"
    log = config.with_suffix(".log")
    try:
        with _mock_backend() as mock_url, raw_backend() as (raw, counts):
            config.write_text(_policy(redis.url, mock_url, raw.url))
            with replicas(config, 1, "--workers", "2", log=log) as [(_, url)]:
                yield Rig(url, int(url.rsplit(":", 1)[1]), redis, mock_url, counts)
    finally:
        redis.close()


def _plan(rng: random.Random, i: int, seed: int) -> Sent:
    """One random request: whose, which backend, how it fails, when its client leaves."""
    rid = f"chaos-{seed}-{i}"
    tight = rng.random() < 0.3
    stream = rng.random() < 0.5
    model = rng.choice(["mock-llm"] * 6 + ["raw-llm"] * 3 + ([] if tight else ["dead-llm"]))
    body: dict[str, Any] = {
        "model": model, "stream": stream, "temperature": 0, "max_tokens": 100,
        "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
    }  # fmt: skip
    fault = rng.choice(["none"] * 5 + ["cut", "slow", "fail"])
    if model == "mock-llm":
        body["mock_completion_tokens"] = rng.choice([20, 60, 150])
        if fault == "cut" and stream:
            body["mock_fail_after_tokens"] = rng.randrange(1, 15)
        elif fault == "slow":
            body["mock_delay_ms"] = 2500  # past the read timeout (1 s)
        elif fault == "fail":
            body["mock_fail"] = 500
    elif model == "raw-llm":
        plan: dict[str, Any] = {"tokens": rng.randrange(1, 100)}  # within max_tokens
        if fault == "cut":
            plan["cut_after"] = rng.randrange(0, plan["tokens"])
        elif fault == "slow":
            plan["delay_s"] = 2.5
        body |= {"hostile": "chaos", "chaos": plan, "chaos_id": rid}
    leave = rng.choice(["never"] * 3 + ["early"] + (["mid", "end"] if stream else []))
    return Sent(rid, TIGHT if tight else ROOMY, body, leave)


async def _traffic(rig: Rig, seed: int) -> list[Sent]:
    rng = random.Random(seed)  # noqa: S311 (a test's dice)
    plans = [_plan(rng, i, seed) for i in range(REQUESTS)]
    gate = asyncio.Semaphore(AT_ONCE)
    restarted = asyncio.Event()

    async def one(i: int, sent: Sent) -> None:
        async with gate:
            await send(rig.port, sent, random.Random(seed * 1000 + i))  # noqa: S311
            if i == RESTART_AT:
                await asyncio.to_thread(rig.redis.stop)
                await asyncio.sleep(1.0)
                await asyncio.to_thread(rig.redis.start)
                restarted.set()

    await asyncio.gather(*(one(i, sent) for i, sent in enumerate(plans)))
    assert restarted.is_set()
    return plans


@pytest.mark.chaos
@pytest.mark.parametrize("seed", SEEDS)
def test_invariants_hold_after_random_failures(rig: Rig, seed: int) -> None:
    chaoscheck.reset_mock_stats(rig.mock_url)
    began = time.monotonic()
    sent = asyncio.run(_traffic(rig, seed))
    statuses = {s.status for s in sent}
    assert {200, 429, 502, 504} <= statuses, statuses  # the chaos happened
    assert any(s.headers.get("x-tokenweir-cache") == "hit" for s in sent)
    records = chaoscheck.settled_ledger(rig.redis.url, [s.rid for s in sent])
    chaoscheck.slots_and_reservations_returned(rig.url, rig.redis.url, ADMIN, DAILY_TOKENS)
    chaoscheck.billed_within_produced(records, sent, rig.raw, rig.mock_url)
    chaoscheck.metrics_match_ledger(rig.url, records)
    chaoscheck.cache_holds_whole_answers(rig.redis.url, rig.port, sent)
    assert time.monotonic() - began < 60
