"""A bounded soak: thousands of mixed requests (streams, whole answers, backend errors, clients
that leave mid-stream) through a real `tokenweir serve` on real Redis. Memory stays flat and no
slot or reservation is left behind. TOKENWEIR_SOAK_S sets the length (CI: 20 s; 120 s for
the full run the issue asks for)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import httpx
import pytest

from tests.redis_server import private_redis
from tests.reliability.state import AUTH, ledger_records, policy_text, slots_held, tokens_reserved
from tests.servers import replicas

SOAK_S = float(os.environ.get("TOKENWEIR_SOAK_S", "20"))
CHAT = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def _one(http: httpx.AsyncClient, i: int) -> None:
    kind = i % 4
    if kind == 0:
        await http.post("/v1/chat/completions", json={**CHAT, "user": f"u{i}"})
    elif kind == 1:
        async with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as a:
            async for _ in a.aiter_bytes():
                pass
    elif kind == 2:  # the client leaves after the first event
        body = {**CHAT, "stream": True, "max_tokens": 400, "mock_completion_tokens": 400}
        async with http.stream("POST", "/v1/chat/completions", json=body) as answer:
            async for _ in answer.aiter_bytes():
                break
    else:
        await http.post("/v1/chat/completions", json={**CHAT, "mock_fail": 500})


async def _load(url: str, seconds: float, workers: int = 16) -> int:
    sent = 0
    deadline = time.monotonic() + seconds

    async def worker(w: int) -> None:
        nonlocal sent
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as http:
            i = w
            while time.monotonic() < deadline:
                await _one(http, i)
                sent += 1
                i += workers

    await asyncio.gather(*(worker(w) for w in range(workers)))
    return sent


@pytest.mark.soak
def test_soak_keeps_memory_flat_and_leaks_no_slot_or_reservation(
    backend_url: str, tmp_path: Path
) -> None:
    with private_redis() as redis_url:
        config = tmp_path / "policy.yaml"
        config.write_text(policy_text(backend_url, redis_url))
        with replicas(config, 1) as [(process, url)]:
            warm = asyncio.run(_load(url, min(5.0, SOAK_S / 4)))
            before = _rss_bytes(process.pid)
            sent = warm + asyncio.run(_load(url, SOAK_S))
            grown = _rss_bytes(process.pid) - before
            deadline = time.monotonic() + 10
            while ledger_records(redis_url) < sent and time.monotonic() < deadline:
                time.sleep(0.1)
            assert slots_held(redis_url) == 0
            assert tokens_reserved(redis_url) == 0
            assert ledger_records(redis_url) == sent  # every request, left or failed, billed
    assert sent >= 1000
    assert grown < 16 * 1024 * 1024, f"grew {grown / 2**20:.1f} MiB over {sent} requests"
