"""Three gateway processes on one real Redis: a quota holds across replicas, exactly."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import redis

from tests.servers import replicas
from tests.web.test_budgets import KEY, budget_policy_text, day_counter

REPLICAS = 3


def test_quota_holds_across_three_replicas(
    backend_url: str, redis_url: str, tmp_path: Path
) -> None:
    quota = 50 * 60
    budget = f"{{tokens_per_day: {quota}, max_output_tokens: 40}}"
    config = tmp_path / "policy.yaml"
    config.write_text(budget_policy_text(backend_url, budget, storage=redis_url))
    body = {
        "model": "mock-llm",
        "stream": True,
        "messages": [{"role": "user", "content": "supercalifragilistic"}],
    }
    with replicas(config, REPLICAS) as started:
        urls = [url for _, url in started]

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
    with redis.Redis.from_url(redis_url) as admin:
        used, reserved = (int(v or 0) for v in admin.hmget(day_counter().key, "used", "reserved"))
    admitted = statuses.count(200)
    assert statuses.count(429) == 200 - admitted
    # Early finishers settle at their real use (45 tokens), below their reservation.
    assert 40 <= admitted <= quota // 45
    assert reserved == 0
    assert used <= quota
