"""SIGTERM on a real `tokenweir serve`: streams in flight finish or are ended cleanly, and the
slots, reservations and ledger records on real Redis are all settled before the process exits."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson

from proxy.tools.mock import backend as mockbackend
from tests.redis_server import private_redis
from tests.reliability.state import (
    AUTH,
    ledger_records,
    policy_text,
    slots_held,
    tokens_reserved,
)
from tests.servers import replicas, serve, told_to_send

CHAT = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "stream": True}
SHORT = {**CHAT, "mock_completion_tokens": 1500}  # 0.75 s at the mock's 2,000 tokens/s
LONG = {**CHAT, "mock_completion_tokens": 20000}  # 10 s: longer than the drain


async def _stream_lines(http: httpx.AsyncClient, body: dict[str, object], started: asyncio.Event,
                        lines: list[str]) -> None:  # fmt: skip
    async with http.stream("POST", "/v1/chat/completions", json=body) as answer:
        assert answer.status_code == 200
        async for line in answer.aiter_lines():
            if line:
                lines.append(line)
                started.set()


async def _sigterm_mid_stream(process: subprocess.Popen[bytes], url: str) -> tuple[
    list[str], list[str], float]:  # fmt: skip
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as http:
        short, long = [], []  # type: tuple[list[str], list[str]]
        short_started, long_started = asyncio.Event(), asyncio.Event()
        tasks = [
            asyncio.create_task(_stream_lines(http, SHORT, short_started, short)),
            asyncio.create_task(_stream_lines(http, LONG, long_started, long)),
        ]
        await asyncio.wait_for(asyncio.gather(short_started.wait(), long_started.wait()), 10)
        process.send_signal(signal.SIGTERM)
        began = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        return short, long, time.monotonic() - began


def test_sigterm_drains_streams_then_settles_everything(backend_url: str, tmp_path: Path) -> None:
    with private_redis() as redis_url:
        config = tmp_path / "policy.yaml"
        config.write_text(policy_text(backend_url, redis_url, server="{drain_timeout: 2s}"))
        with replicas(config, 1) as [(process, url)]:
            short, long, took_s = asyncio.run(_sigterm_mid_stream(process, url))
            assert process.wait(timeout=15) in (0, -signal.SIGTERM)  # uvicorn re-raises it

        assert short[-1] == "data: [DONE]"  # finished within the drain
        assert "data: [DONE]" not in long
        error = orjson.loads(long[-1].removeprefix("data: "))["error"]
        assert error["code"] == "server_shutting_down"
        assert error["type"] == "api_error"
        assert 1.9 <= took_s < 5.0  # cut at the drain timeout, not at uvicorn's
        assert slots_held(redis_url) == 0
        assert tokens_reserved(redis_url) == 0
        assert ledger_records(redis_url) == 2  # the cut stream is billed too


def test_sigterm_without_requests_in_flight_exits_at_once(backend_url: str, tmp_path: Path) -> None:
    with private_redis() as redis_url:
        config = tmp_path / "policy.yaml"
        config.write_text(policy_text(backend_url, redis_url, server="{drain_timeout: 30s}"))
        with replicas(config, 1) as [(process, url)]:
            assert httpx.post(url + "/v1/chat/completions", json={**CHAT, "stream": False},
                              headers=AUTH).status_code == 200  # fmt: skip
            began = time.monotonic()
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=15) in (0, -signal.SIGTERM)  # uvicorn re-raises it
            assert time.monotonic() - began < 5
        assert ledger_records(redis_url) == 1


def test_sigterm_ends_a_request_still_sending_its_body_at_the_drain_timeout(
    backend_url: str, tmp_path: Path
) -> None:
    """A client that has sent half its body when SIGTERM comes (a slow upload, a stalled one) is
    ended with the drain's 503 at the drain timeout, as a request past its body is. It was not
    in the drain's count: uvicorn cancelled it at its own later timeout (the drain's + 5 s, when
    Docker's SIGKILL comes with the default policy), logging an ASGI traceback, with no answer."""
    with private_redis() as redis_url:
        config = tmp_path / "policy.yaml"
        config.write_text(policy_text(backend_url, redis_url, server="{drain_timeout: 2s}"))
        with replicas(config, 1) as [(process, url)]:
            host, port = url.removeprefix("http://").split(":")
            body = orjson.dumps({**CHAT, "stream": False})
            with socket.create_connection((host, int(port)), timeout=30) as client:
                told_to_send(client, AUTH["authorization"], len(body))  # it has the request
                client.sendall(body[: len(body) // 2])
                process.send_signal(signal.SIGTERM)
                began = time.monotonic()
                answer = b""
                while chunk := client.recv(65536):
                    answer += chunk
                took_s = time.monotonic() - began
            assert process.wait(timeout=15) in (0, -signal.SIGTERM)  # uvicorn re-raises it
            stderr = process.stderr.read().decode() if process.stderr else ""
        assert answer.startswith(b"HTTP/1.1 503 "), answer[:200]
        assert b'"code":"server_shutting_down"' in answer
        assert took_s < 5.0  # at the drain's 2 s, not uvicorn's 7 s
        assert "Exception in ASGI application" not in stderr
        assert ledger_records(redis_url) == 1


def test_sigterm_drops_a_stream_whose_client_reads_nothing_at_the_drain_timeout(
    tmp_path: Path,
) -> None:
    """A stream whose client has stopped reading (its socket full) when the drain ends cannot be
    sent the drain's error event: the gateway waited to write it, until uvicorn cancelled the
    request at its own timeout (the drain's + 5 s, Docker's SIGKILL under the default policy),
    logging an ASGI traceback. The connection is dropped at the drain's end instead."""
    fast = mockbackend.create_app(ttft_ms=0, tokens_per_second=20_000)
    with private_redis() as redis_url, serve(fast) as backend_url:
        config = tmp_path / "policy.yaml"
        config.write_text(policy_text(backend_url, redis_url, server="{drain_timeout: 2s}"))
        with replicas(config, 1) as [(process, url)]:
            host, port = url.removeprefix("http://").split(":")
            body = orjson.dumps({**CHAT, "mock_completion_tokens": 100_000})
            with socket.socket() as client:
                client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                client.connect((host, int(port)))
                client.sendall(
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\n"
                    b"authorization: " + AUTH["authorization"].encode() + b"\r\n"
                    b"content-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%b" % (len(body), body)
                )
                assert client.recv(16).startswith(b"HTTP/1.1 200")  # then it reads nothing
                with httpx.Client(base_url=backend_url) as mock:
                    _wait_until_still(lambda: mock.get("/mock/stats").json()["tokens_sent"])
                process.send_signal(signal.SIGTERM)
                began = time.monotonic()
                assert process.wait(timeout=15) in (0, -signal.SIGTERM)  # uvicorn re-raises it
                took_s = time.monotonic() - began
            stderr = process.stderr.read().decode() if process.stderr else ""
        assert took_s < 5.0  # at the drain's 2 s, not uvicorn's 7 s
        assert "Exception in ASGI application" not in stderr
        assert slots_held(redis_url) == 0
        assert tokens_reserved(redis_url) == 0
        assert ledger_records(redis_url) == 1


def _wait_until_still(count: Callable[[], int], within_s: float = 20.0) -> None:
    """Until `count` has not grown for half a second: the stream's relay is held up by its
    client, and the backend by the gateway."""
    deadline = time.monotonic() + within_s
    last, since = count(), time.monotonic()
    while time.monotonic() - since < 0.5:
        assert time.monotonic() < deadline, "the stream never stopped"
        time.sleep(0.05)
        seen = count()
        if seen != last:
            last, since = seen, time.monotonic()
