"""Failover with real mock backends: one refusing connections, one answering 500, one slow,
one dying mid-stream; circuits open and close on an injected clock; fallback models."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest

from proxy.app import create_app
from proxy.clock import FakeClock
from proxy.policy import Policy, parse_policy
from proxy.policy.units import hash_key
from proxy.routing import Pools, Prober
from proxy.tools.mock import backend as mockbackend
from proxy.upstream.client import UpstreamClient, close
from tests.contexts import admitted
from tests.redis_server import wait_until
from tests.servers import free_port, serve
from tests.upstream.hostile import HostileBackend

KEY = "tw-failover"
AUTH = {"authorization": f"Bearer {KEY}"}
CHAT = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def _policy(
    backends: list[tuple[str, str, str]],
    *,
    models: str = "m: {routing: weighted}",
    tenant_models: str = "[m]",
    cache: str = "",
    upstream: str = "",
) -> Policy:
    """`backends`: (name, url, models as YAML flow list); probes off, circuits after 2 failures."""
    listed = "\n".join(
        f'  - {{name: {name}, url: "{url}/v1", models: {served}}}' for name, url, served in backends
    )
    text = f"""
upstream: {{connect_timeout: 1s, read_timeout: 5s, probe_interval: 0,
           circuit: {{failures: 2, open_for: 10s, max_open_for: 60s}}{upstream}}}
backends:
{listed}
models: {{{models}}}
tenants:
  t: {{api_keys: [{hash_key(KEY)}], models: {tenant_models}{cache}}}
"""
    return parse_policy(text, environ={})


@contextmanager
def _mocks(**faults: dict[str, Any]) -> Iterator[dict[str, str]]:
    """Mock backends by name with create_app arguments; `refusing` gets a port nobody serves."""
    with ExitStack() as stack:
        urls = {
            name: stack.enter_context(serve(mockbackend.create_app(**kwargs)))
            for name, kwargs in faults.items()
        }
        urls["refusing"] = f"http://127.0.0.1:{free_port()}"
        yield urls


def _served(url: str) -> int:
    return int(httpx.get(url + "/mock/stats").json()["requests_total"])


def _chat(gateway: str) -> httpx.Response:
    return httpx.post(gateway + "/v1/chat/completions", json=CHAT, headers=AUTH)


def _inflight(url: str) -> int:
    return int(httpx.get(url + "/mock/stats").json()["inflight"])


def test_connect_errors_and_500s_fail_over_to_a_healthy_backend() -> None:
    with _mocks(failing={"fail_status": 500}, good={}) as urls:
        policy = _policy([
            ("refusing", urls["refusing"], "[m]"),
            ("failing", urls["failing"], "[m]"),
            ("good", urls["good"], "[m]"),
        ])  # fmt: skip
        with serve(create_app(policy)) as gateway:
            answers = [
                httpx.post(gateway + "/v1/chat/completions", json=CHAT, headers=AUTH)
                for _ in range(6)
            ]
        assert [a.status_code for a in answers] == [200] * 6
        assert _served(urls["good"]) == 6
        # Each bad backend failed twice, then its circuit opened and it got no more requests.
        assert _served(urls["failing"]) == 2


def test_a_backend_answering_429_is_passed_over_for_its_retry_after() -> None:
    """A backend that answered 429 (its own key's quota spent) kept its turn: every other
    request was a 429 to the client while another backend had room. The request now goes on
    to the next backend, and the limited one is the last choice until its Retry-After (1 s
    without one) has passed; its health is not marked. With no other backend left the 429
    is passed on, its Retry-After with it."""
    clock = FakeClock()
    with _mocks(limited={"fail_status": 429}, good={}) as urls:
        policy = _policy([("limited", urls["limited"], "[m]"), ("good", urls["good"], "[m]")])
        with serve(create_app(policy, clock=clock)) as gateway:
            post = lambda: _chat(gateway)  # noqa: E731
            assert [post().status_code for _ in range(6)] == [200] * 6
            assert (_served(urls["limited"]), _served(urls["good"])) == (1, 6)
            clock.advance(0.5)
            assert [post().status_code for _ in range(3)] == [200] * 3
            assert _served(urls["limited"]) == 1, "held back within its Retry-After"
            clock.advance(0.6)
            assert [post().status_code for _ in range(3)] == [200] * 3
            assert _served(urls["limited"]) == 2, "tried again once its Retry-After passed"
    with _mocks(limited={"fail_status": 429}) as urls:
        policy = _policy([("limited", urls["limited"], "[m]")])
        with serve(create_app(policy, clock=clock)) as gateway:
            answers = [_chat(gateway) for _ in range(3)]
        assert [a.status_code for a in answers] == [429] * 3, "its own 429, never a 503"
        assert all(a.headers["retry-after"] == "1" for a in answers)
        assert _served(urls["limited"]) == 3


def test_attempts_are_bounded_and_the_last_error_is_returned() -> None:
    with _mocks(failing={"fail_status": 500}, good={}) as urls:
        policy = _policy(
            [("refusing", urls["refusing"], "[m]"), ("failing", urls["failing"], "[m]"),
             ("good", urls["good"], "[m]")],
            models="m: {routing: weighted, max_attempts: 2}",
        )  # fmt: skip
        with serve(create_app(policy)) as gateway:
            first = httpx.post(gateway + "/v1/chat/completions", json=CHAT, headers=AUTH)
        assert first.status_code == 502
        assert _served(urls["good"]) == 0


def test_no_retry_after_the_first_byte() -> None:
    with _mocks(dying={"fail_after_tokens": 3}, good={}) as urls:
        policy = _policy([("dying", urls["dying"], "[m]"), ("good", urls["good"], "[m]")])
        with serve(create_app(policy)) as gateway:
            body = {**CHAT, "stream": True, "max_tokens": 50}
            with httpx.stream(
                "POST", gateway + "/v1/chat/completions", json=body, headers=AUTH
            ) as answer:
                text = answer.read().decode()
        assert answer.status_code == 200
        assert '"error"' in text
        assert "[DONE]" not in text
        assert _served(urls["good"]) == 0


def test_a_slow_backend_is_not_retried_but_answers() -> None:
    with _mocks(slow={"ttft_ms": 2000}, good={}) as urls:
        policy = _policy([("slow", urls["slow"], "[m]"), ("good", urls["good"], "[m]")])
        with serve(create_app(policy)) as gateway:
            answer = httpx.post(
                gateway + "/v1/chat/completions", json=CHAT, headers=AUTH, timeout=10
            )
        assert answer.status_code == 200
        assert (_served(urls["slow"]), _served(urls["good"])) == (1, 0)


def test_circuit_opens_then_a_trial_closes_it_on_the_injected_clock() -> None:
    clock = FakeClock()
    with _mocks(good={}) as urls:
        policy = _policy([("only", urls["good"], "[m]")])
        with serve(create_app(policy, clock=clock)) as gateway:
            post = lambda body: httpx.post(  # noqa: E731
                gateway + "/v1/chat/completions", json=body, headers=AUTH
            )
            failing = {**CHAT, "mock_fail": 500}
            assert [post(failing).status_code for _ in range(2)] == [502, 502]
            shut = post(CHAT)
            assert shut.status_code == 503
            assert shut.headers["retry-after"] == "10"
            assert _served(urls["good"]) == 2, "an open circuit sends nothing to the backend"
            clock.advance(10)
            assert post(failing).status_code == 502, "the trial failed: open for 20 s now"
            clock.advance(10)
            assert post(CHAT).status_code == 503
            clock.advance(10)
            assert post(CHAT).status_code == 200, "a good trial closes the circuit"
            assert post(CHAT).status_code == 200


def test_fallback_models_serve_when_every_backend_of_the_model_is_down() -> None:
    with _mocks(small={}) as urls:
        policy = _policy(
            [("big", urls["refusing"], "[m]"), ("small", urls["small"], "[s]")],
            models="m: {fallback_models: [s]}, s: {}",
        )
        with serve(create_app(policy)) as gateway:
            answer = httpx.post(gateway + "/v1/chat/completions", json=CHAT, headers=AUTH)
        assert answer.status_code == 200
        assert answer.json()["model"] == "s"
        assert _served(urls["small"]) == 1


def test_a_fallback_models_answer_is_not_cached_as_the_asked_models() -> None:
    """Stored under the request's key, the fallback's answer would be served as the asked
    model's own by every later request, long after the model's backends are back."""
    with _mocks(small={}) as urls:
        policy = _policy(
            [("big", urls["refusing"], "[m]"), ("small", urls["small"], "[s]")],
            models="m: {fallback_models: [s]}, s: {}",
            cache=", cache: {mode: exact}",
        )
        body = {**CHAT, "temperature": 0}
        with serve(create_app(policy)) as gateway:
            answers = [
                httpx.post(gateway + "/v1/chat/completions", json=body, headers=AUTH)
                for _ in range(2)
            ]
        assert [a.json()["model"] for a in answers] == ["s", "s"]
        assert [a.headers["x-tokenweir-cache"] for a in answers] == ["miss", "miss"]
        assert _served(urls["small"]) == 2


def test_a_tenants_per_model_limits_hold_the_fallback_model_it_may_not_ask_for() -> None:
    """A fallback's requests are admitted on the tenant's `per_model` limits of the model that
    serves them, but a policy setting them on a fallback the tenant may not ask for was refused
    at load: a dear fallback could not be capped without letting clients ask for it."""
    with _mocks(small={}) as urls:
        policy = _policy(
            [("big", urls["refusing"], "[m]"), ("small", urls["small"], "[s]")],
            models="m: {fallback_models: [s]}, s: {}",
            cache=", limits: {per_model: {s: {requests_per_minute: 1}}}",
        )
        with serve(create_app(policy)) as gateway:
            answers = [_chat(gateway) for _ in range(2)]
        assert [a.status_code for a in answers] == [200, 429]
        assert "requests_per_minute" in answers[1].json()["error"]["message"]
        assert _served(urls["small"]) == 1


@pytest.mark.anyio
async def test_a_backend_failing_its_probe_is_out_of_rotation() -> None:
    with _mocks(good={}) as urls:
        policy = _policy([("dead", urls["refusing"], "[m]"), ("good", urls["good"], "[m]")])
        pools = Pools(policy, FakeClock())
        upstream = UpstreamClient(policy.upstream)
        prober = Prober(pools, upstream, 5.0)
        try:
            await prober.probe_once()
            assert pools.health["dead"].probe_error is not None
            assert pools.health["good"].probe_error is None
            assert [h.name for h in pools.pool("m").available(0.0)] == ["good"]
        finally:
            await upstream.aclose()


def test_a_full_connection_pool_is_no_backends_failure() -> None:
    """The gateway's own pool (`max_connections`, shared by every backend) full for a moment:
    the requests that found no connection get 503, and no backend, which heard nothing of
    them, is taken out of rotation (both circuits opened, and the next requests were 503 for
    `open_for` once the pool was free again)."""
    clock = FakeClock()  # a circuit that opened stays open
    with _mocks(a={}, b={}, c={}) as urls:
        policy = _policy(
            [("a", urls["a"], "[m]"), ("b", urls["b"], "[m]"), ("c", urls["c"], "[s]")],
            models="m: {}, s: {}",
            tenant_models="[m, s]",
            upstream=", max_connections: 1, pool_timeout: 0.2s",
        )
        with serve(create_app(policy, clock=clock)) as gateway:
            post = lambda body: httpx.post(  # noqa: E731
                gateway + "/v1/chat/completions", json=body, headers=AUTH, timeout=30
            )
            held: list[httpx.Response] = []
            holder = threading.Thread(
                target=lambda: held.append(post({**CHAT, "model": "s", "mock_delay_ms": 3000}))
            )
            holder.start()
            try:
                wait_until(lambda: _inflight(urls["c"]) == 1, "the held request")
                busy = [post(CHAT) for _ in range(2)]
            finally:
                holder.join()
            assert [a.status_code for a in busy] == [503, 503]
            assert busy[0].headers["retry-after"] == "1"
            assert held[0].status_code == 200
            assert [post(CHAT).status_code for _ in range(2)] == [200, 200]
        assert _served(urls["a"]) + _served(urls["b"]) == 2


@pytest.mark.anyio
async def test_a_probe_that_finds_the_gateways_pool_full_changes_no_backends_health() -> None:
    """A probe waiting in vain for a connection of the gateway's own pool never asked the
    backend: it used to take every backend out of rotation ("failed its probe: PoolTimeout"),
    so a busy gateway refused all requests with 503 until the next probe."""
    with _mocks(good={"tokens_per_second": 10}) as urls:
        policy = _policy(
            [("alive", urls["good"], "[m]"), ("dead", urls["refusing"], "[m]")],
            upstream=", max_connections: 1",
        )
        pools = Pools(policy, FakeClock())
        upstream = UpstreamClient(policy.upstream)
        prober = Prober(pools, upstream, 0.2)
        try:
            await prober.probe_once()  # the pool is free: each probe asks its backend
            assert pools.health["dead"].probe_error is not None
            ctx = admitted(policy.tenants["t"], {**CHAT, "stream": True, "max_tokens": 100})
            alive = pools.health["alive"].backend
            # The pool's one connection, busy with a stream of 10 s.
            held = await upstream.open(ctx, alive, ctx.body)
            try:
                await prober.probe_once()
            finally:
                await close(held)
            assert pools.health["alive"].probe_error is None, pools.health["alive"].probe_error
            assert [h.name for h in pools.pool("m").available(0.0)] == ["alive"]
            assert pools.health["dead"].probe_error is not None, "a finding stays as it was"
        finally:
            await upstream.aclose()


def test_a_backend_whose_streams_break_has_its_circuit_opened() -> None:
    """A stream's headers come before any token, so they prove nothing: a backend whose every
    stream broke off (or sent no event within first_byte_timeout) had its count of failures
    reset by each stream's headers, and its circuit never opened."""
    clock = FakeClock()
    with _mocks(good={"tokens_per_second": 200}) as urls:
        policy = _policy([("only", urls["good"], "[m]")])
        with serve(create_app(policy, clock=clock)) as gateway:

            def stream(**knobs: int) -> tuple[int, str]:
                body = {**CHAT, "stream": True, "max_tokens": 8, **knobs}
                with httpx.stream(
                    "POST", gateway + "/v1/chat/completions", json=body, headers=AUTH, timeout=30
                ) as answer:
                    return answer.status_code, answer.read().decode()

            broken = [stream(mock_fail_after_tokens=2) for _ in range(2)]
            assert [status for status, _ in broken] == [200, 200]
            assert all("[DONE]" not in text for _, text in broken)
            assert stream()[0] == 503, "two broken streams in a row open the circuit"
            assert _served(urls["good"]) == 2
            clock.advance(10)
            status, text = stream()
            assert (status, text.rstrip().endswith("data: [DONE]")) == (200, True)
            assert stream()[0] == 200, "a trial stream that ended well closed the circuit"


def test_a_backend_whose_whole_answers_are_malformed_has_its_circuit_opened() -> None:
    """A 200 whose body is no answer (502 `upstream_bad_response`) is a failure: its head
    reset the count of failures in a row, and such a backend kept every request."""
    with HostileBackend() as hostile:
        policy = _policy([("hostile", hostile.url, "[m]")])
        with serve(create_app(policy, clock=FakeClock())) as gateway:
            answers = [
                httpx.post(
                    gateway + "/v1/chat/completions",
                    json={**CHAT, "hostile": "hello_200"},
                    headers=AUTH,
                )
                for _ in range(3)
            ]
    assert [a.status_code for a in answers] == [502, 502, 503]
    assert answers[0].json()["error"]["code"] == "upstream_bad_response"
