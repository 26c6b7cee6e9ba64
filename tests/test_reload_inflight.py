"""A policy reload that lands while requests are in flight: what they settle against, and what
the next request gets."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from proxy.app import create_app
from proxy.policy.units import hash_key
from proxy.tools.mock import backend as mockbackend
from tests.keys.test_runtime import ADMIN_KEY, CHAT, TENANT_KEY, policy_text
from tests.servers import serve

pytestmark = pytest.mark.anyio

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
ALPHA = {"authorization": f"Bearer {TENANT_KEY}"}
SHORT = {**CHAT, "max_tokens": 1, "mock_completion_tokens": 1}


@pytest.fixture(scope="module")
def slow_backend() -> Iterator[str]:
    """20 tokens/s: a 100-token stream stays open for about five seconds."""
    with serve(mockbackend.create_app(ttft_ms=0, tokens_per_second=20)) as url:
        yield url


async def _stream_opened(
    http: httpx.AsyncClient, opened: asyncio.Event, headers: dict[str, str] = ALPHA
) -> int:
    """A stream with no output bound (its bucket is charged its input, trued up by its output
    at its end), `opened` once it has sent 10 tokens (half a second); its completion tokens."""
    body = {
        "model": "mock-llm",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "mock_completion_tokens": 100,
    }
    tokens = lines = 0
    async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as answer:
        assert answer.status_code == 200
        async for line in answer.aiter_lines():
            lines += line.startswith("data: ")
            if lines >= 10:
                opened.set()
            if '"completion_tokens"' in line:
                tokens = int(line.split('"completion_tokens":')[1].split(",")[0])
    return tokens


@pytest.mark.parametrize("storage", ["memory", "redis"])
async def test_a_stream_ending_after_its_token_limit_was_raised_leaves_the_new_limit(
    slow_backend: str, tmp_path: Path, storage: str, request: pytest.FixtureRequest
) -> None:
    """The stream's true-up (its output, past what admission charged) lands on the bucket as
    the reloaded policy sizes it: it used to be clamped to the old tokens_per_minute, so the
    tenant whose limit was raised from 1,000 to 1,000,000 found about 1,000 left when the
    stream ended, however much the bucket had refilled at the new rate since the reload."""
    url = "memory" if storage == "memory" else request.getfixturevalue("redis_url")
    config = tmp_path / "policy.yaml"
    config.write_text(policy_text(slow_backend, url, limits="{tokens_per_minute: 1000}"))
    with serve(create_app(config=config)) as base:
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            opened = asyncio.Event()
            stream = asyncio.create_task(_stream_opened(http, opened))
            await asyncio.wait_for(opened.wait(), 20)
            config.write_text(policy_text(slow_backend, url, limits="{tokens_per_minute: 1000000}"))
            reloaded = await http.post("/admin/reload", headers=ADMIN)
            during = await http.post("/v1/chat/completions", json=SHORT, headers=ALPHA)
            was_open = not stream.done()
            output_tokens = await stream
            after = await http.post("/v1/chat/completions", json=SHORT, headers=ALPHA)
    assert reloaded.status_code == 200, reloaded.text
    assert was_open  # the reload landed mid-stream
    assert output_tokens == 100
    assert during.headers["x-ratelimit-limit-tokens"] == "1000000"
    assert after.status_code == 200
    assert after.headers["x-ratelimit-limit-tokens"] == "1000000"
    # Since `during`, the bucket refilled at 16,667 tokens a second (the stream ran on for
    # seconds) and was charged the stream's 100 output tokens and `after`'s few: never less.
    left_during = int(during.headers["x-ratelimit-remaining-tokens"])
    assert left_during > 1000  # refilled past the old limit by then (a second at least)
    assert int(after.headers["x-ratelimit-remaining-tokens"]) >= left_during - 120


async def _waiting_across_reload(
    slow_backend: str, url: str, tmp_path: Path, limits: str, before: int, after: int
) -> tuple[str, httpx.Response, httpx.Response]:
    """The tenant's `limits` (with `before`, then `after` in them): a stream takes its one slot,
    a request waits in line behind it, and the policy is reloaded meanwhile. Which of the two
    ended first ("stream" or "waiting"), the waiting request's answer, and the next one's."""
    config = tmp_path / "policy.yaml"
    config.write_text(policy_text(slow_backend, url, limits=limits % before))
    with serve(create_app(config=config)) as base:
        async with httpx.AsyncClient(base_url=base, timeout=60, headers=ALPHA) as http:
            opened = asyncio.Event()
            stream = asyncio.create_task(_stream_opened(http, opened))
            await asyncio.wait_for(opened.wait(), 20)
            waiting = asyncio.create_task(http.post("/v1/chat/completions", json=SHORT))
            await asyncio.sleep(0.3)  # in line behind the stream (which has seconds to go)
            config.write_text(policy_text(slow_backend, url, limits=limits % after))
            reloaded = await http.post("/admin/reload", headers=ADMIN)
            assert reloaded.status_code == 200, reloaded.text
            assert not stream.done()  # the reload landed mid-stream
            done, _ = await asyncio.wait([stream, waiting], return_when=asyncio.FIRST_COMPLETED)
            assert await stream == 100
            waited = await waiting
            next_one = await http.post("/v1/chat/completions", json=SHORT)
    return ("waiting" if waiting in done else "stream"), waited, next_one


@pytest.mark.parametrize("storage", ["memory", "redis"])
async def test_a_request_waiting_for_a_slot_across_a_reload_takes_from_the_new_limit(
    slow_backend: str, tmp_path: Path, storage: str, request: pytest.FixtureRequest
) -> None:
    """A request that joined the line for a slot (queue_timeout) before a reload raised
    tokens_per_minute, and got the slot after it, is charged on the bucket at the new limit:
    it was charged at the old one, which clamped the shared bucket to 1,000 tokens (and the
    next requests found about that much left of the 1,000,000)."""
    url = "memory" if storage == "memory" else request.getfixturevalue("redis_url")
    limits = "{max_concurrent: 1, queue_timeout: 60s, tokens_per_minute: %d}"
    _, waited, after = await _waiting_across_reload(
        slow_backend, url, tmp_path, limits, 1000, 1000000
    )
    assert waited.status_code == 200, waited.text
    assert after.headers["x-ratelimit-limit-tokens"] == "1000000"
    # The stream ran on for seconds after the reload, refilling the bucket at 16,667 a second.
    assert int(after.headers["x-ratelimit-remaining-tokens"]) > 10_000


@pytest.mark.parametrize("storage", ["memory", "redis"])
async def test_a_request_waiting_for_a_slot_gets_one_a_reload_adds(
    slow_backend: str, tmp_path: Path, storage: str, request: pytest.FixtureRequest
) -> None:
    """max_concurrent raised from 1 to 10 while a request waits in line behind a stream: it is
    admitted at once, on the new size of the shared pool. It waited for the old size, until
    the stream ended, while requests arriving after the reload passed it by (a line longer
    than queue_timeout ended in 429s with nine slots free)."""
    url = "memory" if storage == "memory" else request.getfixturevalue("redis_url")
    limits = "{max_concurrent: %d, queue_timeout: 60s}"
    first, waited, _ = await _waiting_across_reload(slow_backend, url, tmp_path, limits, 1, 10)
    assert waited.status_code == 200, waited.text
    assert first == "waiting"  # admitted while the stream still held its slot


async def test_a_reload_that_changes_a_backends_first_byte_timeout_applies_it(
    slow_backend: str, tmp_path: Path
) -> None:
    """`backends[].first_byte_timeout` reloads like the rest of a backend: its timeouts were
    kept by the backend's name from the first request on, so a backend given longer to start
    answering still timed out at the old limit until a restart."""
    config = tmp_path / "policy.yaml"
    text = policy_text(slow_backend, "memory").replace(
        "models: [mock-llm]}", "models: [mock-llm], first_byte_timeout: {}}", 1
    )
    config.write_text(text.replace("{}}", "300ms}", 1))
    slow = {**SHORT, "mock_delay_ms": 1500}
    with serve(create_app(config=config)) as base:
        async with httpx.AsyncClient(base_url=base, timeout=30, headers=ALPHA) as http:
            before = await http.post("/v1/chat/completions", json=slow)
            config.write_text(text.replace("{}}", "20s}", 1))
            reloaded = await http.post("/admin/reload", headers=ADMIN)
            after = await http.post("/v1/chat/completions", json=slow)
    assert before.status_code == 504, before.text
    assert reloaded.status_code == 200, reloaded.text
    assert after.status_code == 200, after.text


def _priced(text: str, output_per_1m: int, ledger: str) -> str:
    """`text` with mock-llm priced (input 1 USD per million tokens) and a ledger."""
    price = f"{{input_per_1m: 1, output_per_1m: {output_per_1m}}}"
    text = text.replace("models: {mock-llm: {}}", f"models: {{mock-llm: {{price: {price}}}}}")
    return f"ledger: {ledger}\n{text}"


async def _usage_total(http: httpx.AsyncClient, requests: int) -> dict[str, int]:
    """/api/usage's total once it holds `requests` records (the ledger writes in batches)."""
    for _ in range(200):
        total: dict[str, int] = (await http.get("/api/usage", headers=ADMIN)).json()["total"]
        if total["requests"] >= requests:
            return total
        await asyncio.sleep(0.1)
    raise AssertionError(f"the ledger holds {total['requests']} records, not {requests}")


@pytest.mark.parametrize("storage", ["memory", "redis"])
async def test_a_stream_in_flight_is_billed_at_the_price_of_its_arrival(
    slow_backend: str, tmp_path: Path, storage: str, request: pytest.FixtureRequest
) -> None:
    """The rule docs/policy.md states: a price a reload changes applies from the next request;
    a stream open at the reload is billed whole at the price it arrived under, once, and the
    ledger, /api/usage and tokenweir_cost_usd_total say the same."""
    url = "memory" if storage == "memory" else request.getfixturevalue("redis_url")
    ledger = f"sqlite:///{tmp_path / 'usage.db'}" if storage == "memory" else "redis"
    config = tmp_path / "policy.yaml"
    text = policy_text(slow_backend, url)
    config.write_text(_priced(text, 1000, ledger))
    with serve(create_app(config=config)) as base:
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            opened = asyncio.Event()
            stream = asyncio.create_task(_stream_opened(http, opened))
            await asyncio.wait_for(opened.wait(), 20)
            config.write_text(_priced(text, 2000, ledger))
            reloaded = await http.post("/admin/reload", headers=ADMIN)
            was_open = not stream.done()
            assert await stream == 100
            after = await http.post("/v1/chat/completions", json=SHORT, headers=ALPHA)
            total = await _usage_total(http, 2)
            metrics = (await http.get("/metrics")).text
    assert reloaded.status_code == 200, reloaded.text
    assert was_open
    assert after.json()["usage"]["completion_tokens"] == 1
    # 1,000 nano-USD an input token; an output token 1,000,000 before the reload, 2,000,000 after
    expected = total["input_tokens"] * 1000 + 100 * 1_000_000 + 1 * 2_000_000
    assert total["requests"] == 2
    assert total["output_tokens"] == 101
    assert total["cost_nusd"] == expected
    cost_lines = [line for line in metrics.splitlines() if line.startswith("tokenweir_cost_usd")]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in cost_lines) == pytest.approx(
        expected / 1e9
    )
    if storage == "memory":  # the SQLite file: each request once, as finally settled
        with sqlite3.connect(tmp_path / "usage.db") as db:
            rows = db.execute(
                "SELECT output_tokens, cost_nusd - input_tokens * 1000 FROM usage_records"
                " WHERE checkpoint = 0 ORDER BY output_tokens"
            ).fetchall()
        assert rows == [(1, 2_000_000), (100, 100_000_000)]


@pytest.mark.parametrize("storage", ["memory", "redis"])
async def test_streams_of_a_removed_tenant_and_a_revoked_key_end_billed_and_free_their_slots(
    slow_backend: str, tmp_path: Path, storage: str, request: pytest.FixtureRequest
) -> None:
    """A reload removes a tenant and lowers max_concurrent from 3 to 1, and a runtime key is
    revoked, while a stream of each is open: each runs to its end and is billed once to its
    tenant and key; the new limit counts the old slots until they end, then admits again."""
    url = "memory" if storage == "memory" else request.getfixturevalue("redis_url")
    ledger = f"sqlite:///{tmp_path / 'usage.db'}" if storage == "memory" else "redis"
    beta_key = "tw-inflight-beta"
    beta = f"  beta:\n    api_keys: [{hash_key(beta_key)}]\n    models: [mock-llm]\n"
    config = tmp_path / "policy.yaml"
    old = policy_text(slow_backend, url, limits="{max_concurrent: 3}")
    config.write_text(_priced(old, 1000, ledger) + beta)
    with serve(create_app(config=config)) as base:
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            made = await http.post("/admin/keys", headers=ADMIN, json={"tenant": "alpha"})
            runtime = {"authorization": f"Bearer {made.json()['key']}"}
            betas = {"authorization": f"Bearer {beta_key}"}
            opened = [asyncio.Event() for _ in range(3)]
            streams = [
                asyncio.create_task(_stream_opened(http, event, headers))
                for event, headers in zip(opened, [ALPHA, runtime, betas], strict=True)
            ]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in opened)), 20)
            new = policy_text(slow_backend, url, limits="{max_concurrent: 1}")
            config.write_text(_priced(new, 1000, ledger))
            reloaded = await http.post("/admin/reload", headers=ADMIN)
            revoked = await http.delete(f"/admin/keys/{made.json()['id']}", headers=ADMIN)
            still_open = sum(not stream.done() for stream in streams)
            during = [
                (await http.post("/v1/chat/completions", json=SHORT, headers=headers)).status_code
                for headers in (ALPHA, runtime, betas)
            ]
            relayed = await asyncio.gather(*streams)
            after = await http.post("/v1/chat/completions", json=SHORT, headers=ALPHA)
            await _usage_total(http, 7)
            by_key = (await http.get("/api/usage?group_by=key", headers=ADMIN)).json()["data"]
    assert reloaded.status_code == 200, reloaded.text
    assert revoked.status_code == 200, revoked.text
    assert still_open == 3
    assert during == [429, 401, 401]  # two slots of one taken; the key and the tenant are gone
    assert relayed == [100, 100, 100]
    assert after.status_code == 200, after.text  # both old slots freed
    billed = {(row["tenant"], row["key"]): row for row in by_key if row["output_tokens"]}
    assert billed[("alpha", made.json()["id"])]["output_tokens"] == 100
    assert billed[("alpha", made.json()["id"])]["requests"] == 1
    assert [row["output_tokens"] for (tenant, _), row in billed.items() if tenant == "beta"] == [
        100
    ]
    if storage == "redis":  # every slot given back: no pool holds a lease
        with redis.Redis.from_url(url) as db:
            assert db.keys("*slots*") == []
