"""Three gateway processes on one real Redis: a quota holds across replicas, exactly."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tests.redis_server import private_redis
from tests.servers import free_port, wait_healthy
from tests.web.test_budgets import KEY, budget_policy_text, day_counter

REPLICAS = 3


@pytest.fixture
def redis_url() -> Iterator[str]:
    with private_redis() as url:
        yield url


def start_replicas(config: Path, count: int) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    processes, urls = [], []
    for _ in range(count):
        port = free_port()
        command = [sys.executable, "-m", "proxy", "serve", "--config", str(config)]
        command += ["--port", str(port), "--no-access-log"]
        processes.append(subprocess.Popen(command, env=os.environ.copy()))
        urls.append(f"http://127.0.0.1:{port}")
    for process, url in zip(processes, urls, strict=True):
        wait_healthy(url, process)
    return processes, urls


def test_quota_holds_across_three_replicas(
    backend_url: str, redis_url: str, tmp_path: Path
) -> None:
    quota = 50 * 60
    budget = f"{{tokens_per_day: {quota}, max_output_tokens: 40}}"
    config = tmp_path / "policy.yaml"
    config.write_text(budget_policy_text(backend_url, budget, storage=redis_url))
    processes, urls = start_replicas(config, REPLICAS)
    body = {
        "model": "mock-llm",
        "stream": True,
        "messages": [{"role": "user", "content": "supercalifragilistic"}],
    }
    try:

        async def race() -> list[int]:
            clients = [
                httpx.AsyncClient(
                    base_url=url, headers={"authorization": f"Bearer {KEY}"}, timeout=30,
                    limits=httpx.Limits(max_connections=100),
                )
                for url in urls
            ]  # fmt: skip
            try:

                async def one(i: int) -> int:
                    http = clients[i % REPLICAS]
                    async with http.stream("POST", "/v1/chat/completions", json=body) as answer:
                        async for _ in answer.aiter_bytes():
                            pass
                        return answer.status_code

                return await asyncio.gather(*(one(i) for i in range(200)))
            finally:
                for client in clients:
                    await client.aclose()

        statuses = asyncio.run(race())
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)
    with redis.Redis.from_url(redis_url) as admin:
        used, reserved = (int(v or 0) for v in admin.hmget(day_counter().key, "used", "reserved"))
    admitted = statuses.count(200)
    assert statuses.count(429) == 200 - admitted
    # Early finishers settle at their real use (45 tokens), below their reservation.
    assert 40 <= admitted <= quota // 45
    assert reserved == 0
    assert used <= quota
