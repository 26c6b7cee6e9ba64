"""A SIGKILL of the gateway with 20 streams open: the ledger and the quota keep each stream's
usage up to its last checkpoint (at most about a second of tokens lost per request, and never
more than the client received), and a restarted gateway's report and quota agree."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from proxy.ledger import SqliteLedger, UsageRecord
from proxy.policy import load_policy
from proxy.policy.units import hash_key
from proxy.stages.budget import _quotas
from proxy.storage import open_store
from tests.conftest import ADMIN_KEY
from tests.reliability.state import ledger_records as redis_ledger_records
from tests.servers import free_port, wait_healthy

KEY = "tw-crash-checkpoint"
TENANT = "app"
STREAMS = 20
TOKENS_PER_S = 20.0
READ_S = 3.5
# The bound: one checkpoint interval of tokens, plus as much again for a loaded machine (a late
# sweep, the ledger's 50 ms write interval, a booking still on its way when the kill came).
LOST_AT_MOST = int(2 * TOKENS_PER_S)


def policy(backend_url: str, redis_url: str, ledger: Path | None) -> str:
    """A tenant with a daily quota, on Redis; a SQLite ledger at `ledger`, else a Redis one."""
    return f"""
storage: {redis_url}
ledger: {"redis" if ledger is None else f"sqlite:///{ledger}"}
admin_keys: [{hash_key(ADMIN_KEY)}]
backends: [{{name: mock, url: "{backend_url}/v1", models: [mock-llm]}}]
models: {{mock-llm: {{}}}}
tenants:
  {TENANT}:
    api_keys: [{hash_key(KEY)}]
    models: [mock-llm]
    budget: {{tokens_per_day: 10000000}}
"""


def start(command: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "proxy", *command], stderr=subprocess.PIPE)


def gateway(config: Path, port: int) -> subprocess.Popen[bytes]:
    return start(["serve", "--config", str(config), "--port", str(port), "--no-access-log"])


async def stream(
    client: openai.AsyncOpenAI,
    n: int,
    received: list[int],
    max_tokens: int = 400,
    started: asyncio.Event | None = None,
) -> None:
    """Read one stream, counting the content deltas (one token each from the mock backend)."""
    try:
        chunks = await client.chat.completions.create(
            model="mock-llm",
            messages=[{"role": "user", "content": f"Stream number {n}, please write at length."}],
            max_tokens=max_tokens,
            stream=True,
            extra_headers={"x-request-id": f"crash-{n}"},
        )
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                received[n] += 1
                if received[n] == 1 and started is not None:
                    started.set()
    except openai.APIError:
        pass  # the gateway died under it


async def read_then_kill(url: str, process: subprocess.Popen[bytes]) -> list[int]:
    """Open the streams, let them run READ_S seconds once every one has a token, SIGKILL."""
    received = [0] * STREAMS
    started = asyncio.Event()
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    tasks = [
        asyncio.create_task(stream(client, n, received, started=started)) for n in range(STREAMS)
    ]
    async with asyncio.timeout(60):  # every stream has a token
        while min(received) == 0:
            await started.wait()
            started.clear()
    assert min(received) > 0, "every stream should have started"
    await asyncio.sleep(READ_S)
    os.kill(process.pid, signal.SIGKILL)
    await asyncio.gather(*tasks)
    await client.close()
    return received


async def ledger_records(path: Path) -> dict[str, UsageRecord]:
    ledger = SqliteLedger(path, read_only=True)
    await ledger.start()
    records = await ledger.latest(TENANT, 1000)
    await ledger.aclose()
    return {r.request_id: r for r in records}


async def quota(config: Path, redis_url: str) -> tuple[int, int]:
    """(used, reserved) of the tenant's daily quota, as the budget stage reads it."""
    quotas = _quotas(TENANT, load_policy(config).tenants[TENANT].budget, time.time())
    store = open_store(redis_url)
    try:
        [(used, reserved)] = await store.read([q.counter for q in quotas])
    finally:
        await store.aclose()
    return used, reserved


def report_tokens(config: Path) -> tuple[int, int]:
    """(requests, input + output tokens) of the tenant, from `tokenweir report`."""
    answer = subprocess.run(
        [sys.executable, "-m", "proxy", "report", "--config", str(config), "--tenant", TENANT,
         "--since", "1d", "--format", "json"],
        capture_output=True, check=True, timeout=60,
    )  # fmt: skip
    [row] = orjson.loads(answer.stdout)["rows"]
    return row["requests"], row["input_tokens"] + row["output_tokens"]


def finish_requests(url: str, count: int) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    for n in range(count):
        client.chat.completions.create(
            model="mock-llm",
            messages=[{"role": "user", "content": f"After the crash, number {n}."}],
            max_tokens=10,
        )


def mock_backend() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    backend = start(["mock-backend", "--port", str(port), "--ttft-ms", "50",
                     "--tokens-per-second", str(TOKENS_PER_S)])  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, backend, path="/v1/models")
    return backend, url


def test_sigkill_with_open_streams_loses_at_most_about_a_second_of_tokens(
    redis_url: str, tmp_path: Path
) -> None:
    backend, backend_url = mock_backend()
    config, ledger = tmp_path / "policy.yaml", tmp_path / "ledger.db"
    config.write_text(policy(backend_url, redis_url, ledger))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    restarted: subprocess.Popen[bytes] | None = None
    try:
        crashed = gateway(config, port)
        wait_healthy(url, crashed)
        received = asyncio.run(read_then_kill(url, crashed))
        crashed.communicate(timeout=30)
        assert crashed.returncode == -signal.SIGKILL

        records = asyncio.run(ledger_records(ledger))
        used, reserved = asyncio.run(quota(config, redis_url))
        assert sorted(records) == sorted(f"crash-{n}" for n in range(STREAMS))
        inputs = 0
        for n, got in enumerate(received):
            kept = records[f"crash-{n}"]
            assert kept.checkpoint  # no final record: the request never ended
            assert 0 < kept.output_tokens <= got  # never more than the client received
            assert got - kept.output_tokens <= LOST_AT_MOST, (n, got, kept.output_tokens)
            assert kept.input_tokens > 0
            inputs += kept.input_tokens
        relayed = inputs + sum(received)
        # The quota booked the same usage so far: never more than relayed, at most the bound less.
        assert relayed - STREAMS * LOST_AT_MOST <= used <= relayed
        assert reserved > 0  # the dead requests' leases hold the rest until they expire

        restarted = gateway(config, port)
        wait_healthy(url, restarted)
        requests, reported = report_tokens(config)
        assert requests == STREAMS
        # Report and quota agree, but for the checkpoint that may have been on its way at the
        # kill (its ledger write and its quota booking are separate calls).
        assert abs(reported - used) <= STREAMS * LOST_AT_MOST
        assert relayed - STREAMS * LOST_AT_MOST <= reported <= relayed
        finish_requests(url, 3)
        deadline = time.monotonic() + 30
        while report_tokens(config)[0] < STREAMS + 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        requests_after, reported_after = report_tokens(config)
        used_after, _ = asyncio.run(quota(config, redis_url))
        assert requests_after == STREAMS + 3
        assert reported_after - reported == used_after - used > 0  # settled requests: exactly
    finally:
        for process in (restarted, backend):
            if process is not None and process.poll() is None:
                process.terminate()
                process.communicate(timeout=30)


async def read_to_the_end(url: str, count: int, max_tokens: int) -> list[int]:
    received = [0] * count
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    await asyncio.gather(*(stream(client, n, received, max_tokens) for n in range(count)))
    await client.close()
    return received


@pytest.mark.parametrize("ledger_kind", ["sqlite", "redis"])
def test_streams_checkpointed_along_the_way_are_counted_once_everywhere(
    redis_url: str, tmp_path: Path, ledger_kind: str
) -> None:
    """Streams of ~2.5 s (two checkpoints each) that end normally: the quota, the raw records,
    `tokenweir report`, /api/usage and the dashboard's quota bar all count each one once."""
    backend, backend_url = mock_backend()
    config = tmp_path / "policy.yaml"
    ledger = tmp_path / "ledger.db" if ledger_kind == "sqlite" else None
    config.write_text(policy(backend_url, redis_url, ledger))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    served = gateway(config, port)
    count, max_tokens = 5, int(2.5 * TOKENS_PER_S)
    try:
        wait_healthy(url, served)
        received = asyncio.run(read_to_the_end(url, count, max_tokens))
        deadline = time.monotonic() + 30
        while report_tokens(config)[0] < count and time.monotonic() < deadline:
            time.sleep(0.2)
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        [row] = httpx.get(f"{url}/api/usage?since=1d&tenant={TENANT}", headers=admin).json()["data"]
        page = httpx.get(url + "/dashboard", headers=admin).text
    finally:
        for process in (served, backend):
            process.terminate()
            process.communicate(timeout=30)
    assert received == [max_tokens] * count
    used, reserved = asyncio.run(quota(config, redis_url))
    assert reserved == 0
    requests, reported = report_tokens(config)
    assert (requests, reported) == (count, used)
    assert (row["requests"], row["input_tokens"] + row["output_tokens"]) == (count, used)
    assert row["output_tokens"] == sum(received)
    [bar] = re.findall(r'class="qused">([\d,]+) / 10,000,000 tokens', page)
    assert int(bar.replace(",", "")) == used
    if ledger is None:
        assert redis_ledger_records(redis_url, TENANT) == count  # the checkpoints were replaced
    else:
        records = asyncio.run(ledger_records(ledger))
        assert len(records) == count
        assert not any(r.checkpoint for r in records.values())
