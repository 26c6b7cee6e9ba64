"""A stream's mid-stream quota booking (a checkpoint's charge) lost on its way to Redis, or run
with its reply lost: the tenant's quota after the request holds exactly what the ledger billed,
neither less (a charge that never ran) nor more (one that ran, counted again)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
import redis

from proxy.ledger import SqliteLedger, UsageRecord
from proxy.policy.units import hash_key
from tests.redis_server import RedisProcess
from tests.reliability.cutproxy import CHARGE, CutProxy
from tests.reliability.state import day_quota
from tests.servers import free_port, replicas, wait_healthy

KEY = "tw-lost-charges"
TENANT = "app"


def until(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.fixture(scope="module")
def slow_backend() -> Iterator[str]:
    """The mock backend at 20 tokens a second: a stream of 60 tokens spans a few checkpoints."""
    port = free_port()
    command = [sys.executable, "-m", "proxy", "mock-backend", "--port", str(port),
               "--ttft-ms", "50", "--tokens-per-second", "20"]  # fmt: skip
    backend = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, backend, path="/v1/models")
        yield url
    finally:
        backend.terminate()
        backend.wait(30)


def policy(backend_url: str, storage: str, ledger: Path) -> str:
    return f"""
storage: {storage}
ledger: sqlite:///{ledger}
backends: [{{name: mock, url: "{backend_url}/v1", models: [mock-llm]}}]
models: {{mock-llm: {{}}}}
tenants:
  {TENANT}:
    api_keys: [{hash_key(KEY)}]
    models: [mock-llm]
    budget: {{tokens_per_day: 10000000}}
"""


def leases_held(redis_url: str) -> int:
    """Quota leases not yet settled (a settle releases its lease in the same call)."""
    with redis.Redis.from_url(redis_url) as client:
        return sum(int(client.zcard(key)) for key in client.scan_iter("tw:*:leases"))


async def final_record(path: Path, request_id: str) -> UsageRecord | None:
    ledger = SqliteLedger(path, read_only=True)
    await ledger.start()
    try:
        records = await ledger.latest(TENANT, 10)
    finally:
        await ledger.aclose()
    return next((r for r in records if r.request_id == request_id and not r.checkpoint), None)


@pytest.mark.parametrize("passed_on", [False, True], ids=["never-ran", "reply-lost"])
def test_a_lost_checkpoint_charge_leaves_the_quota_equal_to_what_the_ledger_billed(
    slow_backend: str, tmp_path: Path, passed_on: bool
) -> None:
    """The first checkpoint's charge is swallowed by the network (never ran), or run and its
    reply lost with the connection. Before, the gateway kept the first as booked: its tokens
    were missing from the quota for good (1,002 booked against 1,205 used, measured)."""
    server = RedisProcess()
    server.start()
    try:
        with CutProxy(server.port) as relay:
            config, ledger = tmp_path / "policy.yaml", tmp_path / "ledger.db"
            storage = f"redis://127.0.0.1:{relay.port}/0"
            config.write_text(policy(slow_backend, storage, ledger))
            with replicas(config, 1) as [(_, url)]:
                client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
                relay.cut_next(CHARGE, passed_on=passed_on)
                chunks = client.chat.completions.create(
                    model="mock-llm",
                    messages=[{"role": "user", "content": "Please write at length."}],
                    max_tokens=60,
                    stream=True,
                    extra_headers={"x-request-id": "lost-charge"},
                )
                received = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
                assert relay.cut, "a checkpoint's charge went through the relay"
                until(lambda: leases_held(server.url) == 0, "the request settles its quota")
                record: list[UsageRecord | None] = [None]

                def billed() -> bool:
                    record[0] = asyncio.run(final_record(ledger, "lost-charge"))
                    return record[0] is not None

                until(billed, "the ledger has the request's final record")
        final = record[0]
        assert final is not None
        assert final.output_tokens == received == 60
        used, reserved = day_quota(server.url)
        assert (used, reserved) == (final.input_tokens + final.output_tokens, 0)
    finally:
        server.close()
