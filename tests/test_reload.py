"""Policy reload through the admin API: under load, refused when broken, keeping the limits."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy import reload as reload_module
from proxy.app import create_app
from proxy.policy import Policy
from proxy.policy.units import hash_key
from proxy.tokens import TokenCounter, counters
from proxy.tools.mock import backend as mockbackend
from tests.servers import free_port, serve
from tests.shared import tokenizer_file

pytestmark = pytest.mark.anyio

ADMIN_KEY = "tw-reload-admin"
OLD_KEY = "tw-reload-leaked"
STAY_KEY = "tw-reload-stays"
NEW_KEY = "tw-reload-newcomer"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
CHAT = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def policy_text(
    backend_url: str, *, leaked_key: bool = True, newcomer: bool = False, limits: str = "{}"
) -> str:
    keys = [hash_key(STAY_KEY), *([hash_key(OLD_KEY)] if leaked_key else [])]
    text = f"""storage: memory
admin_keys: [{hash_key(ADMIN_KEY)}]
backends: [{{name: mock, url: "{backend_url}/v1", models: [mock-llm]}}]
models: {{mock-llm: {{}}}}
tenants:
  alpha:
    api_keys: [{", ".join(keys)}]
    models: [mock-llm]
    limits: {limits}
"""
    if newcomer:
        text += f"  gamma:\n    api_keys: [{hash_key(NEW_KEY)}]\n    models: [mock-llm]\n"
    return text


@pytest.fixture(scope="module")
def slow_backend() -> Iterator[str]:
    """50 tokens/s: a 100-token stream stays open for about two seconds."""
    with serve(mockbackend.create_app(ttft_ms=0, tokens_per_second=50)) as url:
        yield url


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def _stream(http: httpx.AsyncClient, started: asyncio.Event, opened: list[int]) -> bytes:
    body = {**CHAT, "stream": True, "max_tokens": 100, "mock_completion_tokens": 100}
    received = b""
    async with http.stream(
        "POST", "/v1/chat/completions", json=body, headers=_bearer(OLD_KEY)
    ) as answer:
        assert answer.status_code == 200
        async for chunk in answer.aiter_bytes():
            if not received:
                opened.append(1)
                if len(opened) == 20:
                    started.set()
            received += chunk
    return received


async def test_reload_under_load_adds_a_tenant_and_revokes_a_key(
    slow_backend: str, tmp_path: Path
) -> None:
    config = tmp_path / "policy.yaml"
    config.write_text(policy_text(slow_backend))
    with serve(create_app(config=config)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            before = (await http.get("/readyz")).json()["policy_hash"]
            started, opened = asyncio.Event(), []
            streams = [asyncio.create_task(_stream(http, started, opened)) for _ in range(20)]
            await asyncio.wait_for(started.wait(), 20)
            config.write_text(policy_text(slow_backend, leaked_key=False, newcomer=True))
            reloaded = await http.post("/admin/reload", headers=ADMIN)
            revoked = await http.post("/v1/chat/completions", json=CHAT, headers=_bearer(OLD_KEY))
            newcomer = await http.post("/v1/chat/completions", json=CHAT, headers=_bearer(NEW_KEY))
            stayed = await http.post("/v1/chat/completions", json=CHAT, headers=_bearer(STAY_KEY))
            still_open = sum(not s.done() for s in streams)
            usage_revoked = await http.get("/api/usage", headers=_bearer(OLD_KEY))
            usage_newcomer = await http.get("/api/usage", headers=_bearer(NEW_KEY))
            bodies = await asyncio.gather(*streams)
            ready = (await http.get("/readyz")).json()
            metrics = (await http.get("/metrics")).text
    assert reloaded.status_code == 200, reloaded.text
    assert reloaded.json()["status"] == "reloaded"
    assert reloaded.json()["previous_hash"] == before
    assert revoked.status_code == 401
    assert newcomer.status_code == 200
    assert stayed.status_code == 200
    assert still_open > 0  # the reload happened while streams were open
    assert usage_revoked.status_code == 401  # the usage API follows the reload too
    assert usage_newcomer.json()["error"]["code"] == "no_ledger"  # authenticated; no ledger
    for body in bodies:  # each finished under the policy it started with
        assert body.endswith(b"data: [DONE]\n\n")
        assert body.count(b'"content"') >= 100
    assert ready["policy_hash"] == reloaded.json()["policy_hash"] != before
    assert f'tokenweir_policy_info{{hash="{ready["policy_hash"]}"}} 1.0' in metrics


async def test_a_broken_file_is_refused_and_nothing_changes(
    slow_backend: str, tmp_path: Path
) -> None:
    config = tmp_path / "policy.yaml"
    config.write_text(policy_text(slow_backend))
    with serve(create_app(config=config)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            before = (await http.get("/readyz")).json()["policy_hash"]
            broken = policy_text(slow_backend, leaked_key=False, newcomer=True)
            config.write_text(
                broken.replace("    limits: {}\n", "    limits: {}\n    modles: [x]\n")
            )
            refused = await http.post("/admin/reload", headers=ADMIN)
            old_key = await http.post("/v1/chat/completions", json=CHAT, headers=_bearer(OLD_KEY))
            new_key = await http.post("/v1/chat/completions", json=CHAT, headers=_bearer(NEW_KEY))
            after = (await http.get("/readyz")).json()["policy_hash"]
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_policy"
    assert f"{config}:10: tenants.alpha.modles" in error["message"]
    assert old_key.status_code == 200
    assert new_key.status_code == 401
    assert after == before


async def test_an_alias_bomb_is_refused_and_the_gateway_goes_on(
    slow_backend: str, tmp_path: Path
) -> None:
    """A "billion laughs" reloaded took the gateway's event loop for good (every request in
    flight and every new one stalled); it is refused at once, naming where, and nothing changes."""
    config = tmp_path / "policy.yaml"
    config.write_text(policy_text(slow_backend))
    levels = [f"a{n}: &a{n} [{', '.join([f'*a{n - 1}'] * 9)}]" for n in range(1, 9)]
    bomb = "a0: &a0 [x, x, x, x, x, x, x, x, x]\n" + "\n".join(levels) + "\n"
    with serve(create_app(config=config)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            before = (await http.get("/readyz")).json()["policy_hash"]
            config.write_text(bomb + policy_text(slow_backend, newcomer=True))
            refused = await http.post("/admin/reload", headers=ADMIN)
            old_key = await http.post("/v1/chat/completions", json=CHAT, headers=_bearer(OLD_KEY))
            after = (await http.get("/readyz")).json()["policy_hash"]
    assert refused.status_code == 400
    assert f"{config}:6: a5: aliases here repeat more values" in refused.json()["error"]["message"]
    assert old_key.status_code == 200
    assert after == before


async def test_a_budget_of_inf_is_refused_and_requests_go_on(
    slow_backend: str, tmp_path: Path
) -> None:
    """`usd_per_day: .inf` (or 1.0e300) reloaded without a word, then every request of the
    tenant was a 500 (an OverflowError turning it into nano-USD); it is refused, naming the
    line, and the old policy keeps serving."""
    config = tmp_path / "policy.yaml"
    config.write_text(policy_text(slow_backend))
    with serve(create_app(config=config)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            infinite = policy_text(slow_backend).replace(
                "    limits: {}\n", "    limits: {}\n    budget: {usd_per_day: .inf}\n"
            )
            config.write_text(infinite)
            refused = await http.post("/admin/reload", headers=ADMIN)
            chat = await http.post("/v1/chat/completions", json=CHAT, headers=_bearer(OLD_KEY))
    assert refused.status_code == 400
    message = refused.json()["error"]["message"]
    assert f"{config}:10: tenants.alpha.budget.usd_per_day: expected a finite number" in message
    assert chat.status_code == 200, chat.text


async def test_a_reload_keeps_the_limits_of_tenants_that_stay(
    slow_backend: str, tmp_path: Path
) -> None:
    config = tmp_path / "policy.yaml"
    config.write_text(policy_text(slow_backend, limits="{requests_per_minute: 2}"))
    with serve(create_app(config=config)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30, headers=_bearer(STAY_KEY)) as http:
            for _ in range(2):
                assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
            config.write_text(
                policy_text(slow_backend, newcomer=True, limits="{requests_per_minute: 2}")
            )
            assert (await http.post("/admin/reload", headers=ADMIN)).status_code == 200
            third = await http.post("/v1/chat/completions", json=CHAT)
    assert third.status_code == 429
    assert third.headers["x-ratelimit-remaining-requests"] == "0"


async def test_sections_bound_at_start_are_refused_and_tenant_keys_may_not_reload(
    slow_backend: str, tmp_path: Path
) -> None:
    config = tmp_path / "policy.yaml"
    config.write_text(policy_text(slow_backend))
    with serve(create_app(config=config)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            config.write_text(policy_text(slow_backend).replace("memory", "redis://127.0.0.1:1/0"))
            refused = await http.post("/admin/reload", headers=ADMIN)
            by_tenant = await http.post("/admin/reload", headers=_bearer(STAY_KEY))
            anonymous = await http.post("/admin/reload")
    assert refused.status_code == 400
    assert "storage changed, which takes a restart" in refused.json()["error"]["message"]
    assert by_tenant.status_code == 403
    assert anonymous.status_code == 401


async def test_a_tokenizer_that_cannot_load_is_refused_and_nothing_changes(
    slow_backend: str, tmp_path: Path
) -> None:
    """The file is well formed, but its tokenizer is not there: a refusal, not a 500."""
    config = tmp_path / "policy.yaml"
    config.write_text(policy_text(slow_backend))
    missing = "models: {mock-llm: {tokenizer: /nonexistent/tokenizer.json}}"
    with serve(create_app(config=config)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            before = (await http.get("/readyz")).json()["policy_hash"]
            text = policy_text(slow_backend, newcomer=True)
            config.write_text(text.replace("models: {mock-llm: {}}", missing))
            refused = await http.post("/admin/reload", headers=ADMIN)
            new_key = await http.post("/v1/chat/completions", json=CHAT, headers=_bearer(NEW_KEY))
            old_key = await http.post("/v1/chat/completions", json=CHAT, headers=_bearer(OLD_KEY))
            after = (await http.get("/readyz")).json()["policy_hash"]
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "invalid_policy"
    assert "tokenizer '/nonexistent/tokenizer.json'" in error["message"]
    assert "old policy keeps serving" in error["message"]
    assert new_key.status_code == 401
    assert old_key.status_code == 200
    assert after == before


def _with_tokenizers(backend_url: str, models: dict[str, str], price: str = "0.4") -> str:
    """policy_text with `models` (name: tokenizer spec), all on the mock backend."""
    specs = ", ".join(
        f'{name}: {{tokenizer: "{spec}", price: {{input_per_1m: 0.1, output_per_1m: {price}}}}}'
        for name, spec in models.items()
    )
    return (
        policy_text(backend_url)
        .replace("models: [mock-llm]}]", f"models: [{', '.join(models)}]}}]", 1)
        .replace("models: {mock-llm: {}}", f"models: {{{specs}}}")
    )


async def test_a_reload_loads_only_new_tokenizers_and_not_on_the_event_loop(
    slow_backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A price change loads no tokenizer; a new one loads in a worker thread, with the loop
    answering meanwhile (the loading is held until /healthz has answered: event order, no
    timing). What a loader does itself with the GIL is not tested here: `tokenizers` holds it."""
    mini = str(tokenizer_file("all-MiniLM-L6-v2/tokenizer.json"))
    events: list[str] = []
    loading, healthz_answered = threading.Event(), threading.Event()
    real_load = counters.load_counter

    def watched_load(spec: str | None, *, model: str, base_dir: Path | None = None) -> TokenCounter:
        events.append(f"load {model}")
        if model == "mock-new":  # held (up to a generous limit) until the loop has answered
            loading.set()
            healthz_answered.wait(20)
        loaded = real_load(spec, model=model, base_dir=base_dir)
        events.append(f"loaded {model}")
        return loaded

    monkeypatch.setattr(counters, "load_counter", watched_load)
    config = tmp_path / "policy.yaml"
    config.write_text(_with_tokenizers(slow_backend, {"mock-llm": mini}))
    with serve(create_app(config=config)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            assert events == ["load mock-llm", "loaded mock-llm"]  # at startup
            events.clear()
            config.write_text(_with_tokenizers(slow_backend, {"mock-llm": mini}, price="0.5"))
            price_only = await http.post("/admin/reload", headers=ADMIN)
            assert price_only.json()["status"] == "reloaded", price_only.text
            assert events == []  # the tokenizer it had is kept
            config.write_text(
                _with_tokenizers(slow_backend, {"mock-llm": mini, "mock-new": f"{mini}#chatml"})
            )
            await _reload_while_the_loop_answers(http, loading, healthz_answered, events)
    assert events == ["load mock-new", "healthz answered", "loaded mock-new"]


async def test_a_reload_that_changes_a_price_keeps_a_dead_backend_out(
    backend_url: str, tmp_path: Path
) -> None:
    """A backend its probe found dead stays out of rotation after a reload that leaves it as
    it was (here only a price changes): every backend's health used to start again, so the
    dead one took its turn until the next probe, and a model allowed one attempt got a 502."""
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens: connections are refused

    def text(price: int) -> str:
        good = f'{{name: mock, url: "{backend_url}/v1", models: [mock-llm]}}'
        return (
            policy_text(backend_url)
            .replace(good, f'{{name: dead, url: "{dead}", models: [mock-llm]}}, {good}')
            .replace(
                "models: {mock-llm: {}}",
                f"models: {{mock-llm: {{max_attempts: 1, price: {{input_per_1m: {price}}}}}}}",
            )
            # Its circuit, once open, stays so past the reload (which waits 0.5 s for the file
            # to hold still) on a loaded machine: a trial would take one request's turn.
            + "upstream: {probe_interval: 5s, circuit: {open_for: 60s}}\n"
        )

    config = tmp_path / "policy.yaml"
    config.write_text(text(1))
    with serve(create_app(config=config)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30, headers=_bearer(STAY_KEY)) as http:
            in_a_row = 0
            for _ in range(200):  # until the dead backend is out (its probe, or its circuit)
                answer = await http.post("/v1/chat/completions", json=CHAT)
                in_a_row = in_a_row + 1 if answer.status_code == 200 else 0
                if in_a_row == 6:
                    break
                await asyncio.sleep(0.1)
            assert in_a_row == 6, "the dead backend never left the rotation"
            config.write_text(text(2))
            reloaded = await http.post("/admin/reload", headers=ADMIN)
            assert reloaded.json()["status"] == "reloaded"
            after = [(await http.post("/v1/chat/completions", json=CHAT)) for _ in range(4)]
    assert [a.status_code for a in after] == [200] * 4, after[0].text


async def test_a_reload_parses_the_file_off_the_event_loop(
    slow_backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file was read and parsed on the event loop: a policy of many MB (seconds of YAML)
    stalled every stream in flight and every new request until it was done. The parse is held
    here until /healthz has answered (event order, no timing)."""
    events: list[str] = []
    parsing, healthz_answered = threading.Event(), threading.Event()
    real_parse = reload_module.parse_policy

    def held_parse(text: str, **kwargs: Any) -> Policy:
        events.append("parsing")
        parsing.set()
        healthz_answered.wait(20)
        parsed = real_parse(text, **kwargs)
        events.append("parsed")
        return parsed

    config = tmp_path / "policy.yaml"
    config.write_text(policy_text(slow_backend))
    with serve(create_app(config=config)) as url:
        monkeypatch.setattr(reload_module, "parse_policy", held_parse)
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            config.write_text(policy_text(slow_backend, newcomer=True))
            await _reload_while_the_loop_answers(http, parsing, healthz_answered, events)
    assert events == ["parsing", "healthz answered", "parsed"]


async def _reload_while_the_loop_answers(
    http: httpx.AsyncClient, held: threading.Event, answered: threading.Event, events: list[str]
) -> None:
    """Reload; once the reload's work in a thread has started (`held`, which it holds until
    `answered`), /healthz must answer, then the reload finishes."""
    reloading = asyncio.create_task(http.post("/admin/reload", headers=ADMIN))
    assert await asyncio.to_thread(held.wait, 30)
    health = await http.get("/healthz")
    assert health.status_code == 200
    events.append("healthz answered")
    answered.set()
    reloaded = await reloading
    assert reloaded.json()["status"] == "reloaded", reloaded.text
