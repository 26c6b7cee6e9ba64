"""`tokenweir serve --workers 2` with streams open on both workers: one worker killed (SIGKILL)
breaks its own streams only, and its slots and quota reservations come back at their lease's
end; then SIGTERM drains the streams of both workers, and gives back every slot and reservation
they held."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx

from proxy.tools.mock import backend as mockbackend
from tests.redis_server import private_redis
from tests.reliability.state import KEY, policy_text, slots_held, tokens_reserved
from tests.servers import serve
from tests.test_cli_reload import tokenweir_serve
from tests.test_cli_workers import _eventually

_WAIT_S = 60.0  # a limit on a loaded 2-core machine, not a measurement


def test_a_worker_killed_mid_stream_breaks_its_streams_alone_and_sigterm_drains_both(
    tmp_path: Path,
) -> None:
    with (
        serve(mockbackend.create_app(ttft_ms=0, tokens_per_second=20)) as backend,
        private_redis() as redis_url,
        ThreadPoolExecutor(8) as pool,
    ):
        config = tmp_path / "policy.yaml"
        config.write_text(policy_text(backend, redis_url, extra=", lease_ttl: 2s"))
        with tokenweir_serve(config, "--workers", "2") as (process, url):
            streams = _on_both_workers(url, pool, tokens=400)  # 20 s each
            victim = min(streams)
            os.kill(victim, signal.SIGKILL)
            broken = [stream.result(timeout=_WAIT_S) for stream in streams.pop(victim)]
            assert all(error is not None for _, error in broken)  # cut: no [DONE]
            for stream in streams.popitem()[1]:  # the other worker's run on, to their end
                assert stream.result(timeout=_WAIT_S) == (True, None)
            _eventually(lambda: slots_held(redis_url) == 0)  # the dead one's at their lease's end
            # Its reservations' leases (lease_ttl, as the slots') have ended too: the next
            # reservation on the same counters sweeps them (they held 60 s whatever lease_ttl).
            assert tokens_reserved(redis_url) > 0
            late = _on_both_workers(url, pool, tokens=60)  # 3 s each
            process.send_signal(signal.SIGTERM)
            ended = [s.result(timeout=_WAIT_S) for group in late.values() for s in group]
            assert ended == [(True, None)] * 4  # drained, on both workers
            assert process.wait(timeout=_WAIT_S) == 0
        assert slots_held(redis_url) == 0
        assert tokens_reserved(redis_url) == 0  # the dead worker's swept, the drained given back


Stream = Future[tuple[bool, str | None]]


def _on_both_workers(url: str, pool: ThreadPoolExecutor, tokens: int) -> dict[int, list[Stream]]:
    """Two streams running on each worker, by pid (connections are opened until each worker
    has taken two, the others closed)."""
    taken: dict[int, list[Stream]] = {}
    began = time.monotonic()
    while sorted(len(group) for group in taken.values()) != [2, 2]:
        assert time.monotonic() - began < _WAIT_S, f"streams by worker: {taken}"
        http = httpx.Client(base_url=url, timeout=_WAIT_S)
        pid = http.get("/readyz?backends=skip").json()["pid"]
        if len(taken.setdefault(pid, [])) == 2:
            http.close()
            continue
        flowing = pool.submit(_stream, http, tokens)
        taken[pid].append(flowing)
    return taken


def _stream(http: httpx.Client, tokens: int) -> tuple[bool, str | None]:
    """A stream of `tokens` tokens on this connection: whether it ended with [DONE], and the
    error that cut it, if one did."""
    body = {
        "model": "mock-llm", "stream": True, "max_tokens": tokens,
        "messages": [{"role": "user", "content": "hi"}], "mock_completion_tokens": tokens,
    }  # fmt: skip
    headers = {"authorization": f"Bearer {KEY}"}
    tail = b""
    try:
        with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as answer:
            for chunk in answer.iter_bytes():
                tail = (tail + chunk)[-64:]
    except httpx.TransportError as exc:
        return False, type(exc).__name__
    finally:
        http.close()
    return tail.endswith(b"data: [DONE]\n\n"), None
