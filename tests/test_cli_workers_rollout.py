"""`tokenweir serve --workers N` reloads its workers one at a time: while one builds the new
policy's tokenizer (its GIL held: it answers nothing), the others serve. A tokenizer.json that is
a FIFO holds a worker in the build for as long as the test likes: the order of events, no timing."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.policy.units import hash_key
from tests.redis_server import private_redis
from tests.reliability.state import KEY, policy_text
from tests.test_cli_reload import tokenweir_serve
from tests.test_cli_workers import CHAT, _both_workers, _digest
from tests.test_reload import ADMIN, ADMIN_KEY

Held = list[Future[Any]]
_WAIT_S = 60.0  # a limit on a loaded 2-core machine, not a measurement
_TOKENIZER = json.dumps({
    "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
    "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
    "decoder": None,
    "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hi": 1}, "unk_token": "[UNK]"},
}).encode()  # fmt: skip


@pytest.mark.parametrize("trigger", ["sighup", "watch", "admin"])
def test_a_reload_building_a_tokenizer_leaves_the_other_worker_serving(
    backend_url: str, tmp_path: Path, trigger: str
) -> None:
    """SIGHUP reached every worker at once (and with `--watch` each worker watched the file), so
    both built the new tokenizer together and neither answered meanwhile (a large
    tokenizer.json: seconds). Now one reloads, then the other: each request sent while a worker
    builds is answered by the other one; `POST /admin/reload` answers once both are done."""
    tokenizer = tmp_path / "tokenizer.json"
    os.mkfifo(tokenizer)
    with private_redis() as redis_url, ThreadPoolExecutor(9) as pool:
        config = tmp_path / "policy.yaml"
        text = policy_text(backend_url, redis_url) + f"admin_keys: [{hash_key(ADMIN_KEY)}]\n"
        config.write_text(text)
        options = ("--workers", "2", "--watch") if trigger == "watch" else ("--workers", "2")
        with tokenweir_serve(config, *options) as (process, url):
            old = _both_workers(url)
            config.write_text(
                text.replace("mock-llm: {}", f'mock-llm: {{tokenizer: "{tokenizer}"}}')
            )
            new = _digest(config)
            if trigger == "sighup":
                os.kill(process.pid, signal.SIGHUP)
            admin = pool.submit(_admin_reload, url) if trigger == "admin" else None
            with _building(tokenizer):  # one worker is held in the build
                answered, held = _answers(url, pool)
            _answered_at_last(held)
            (serving,) = answered  # the other one answered every request
            assert answered[serving] == old[serving]  # on the old policy
            _eventually_serving(url, new)  # the first one is done
            with _building(tokenizer):  # and now the other one
                answered, held = _answers(url, pool)
                assert admin is None or not admin.done()
            _answered_at_last(held)
            (reloaded,) = answered
            assert reloaded != serving
            assert answered[reloaded] == new
            if admin is not None:
                assert admin.result(timeout=_WAIT_S) == {"status": "reloaded", "policy_hash": new}
            assert _both_workers(url) == dict.fromkeys(old, new)  # the same two, reloaded


def _admin_reload(url: str) -> dict[str, str]:
    with httpx.Client(timeout=_WAIT_S) as http:
        answer = http.post(url + "/admin/reload", headers=ADMIN).json()
    return {"status": answer["status"], "policy_hash": answer["policy_hash"]}


@contextlib.contextmanager
def _building(fifo: Path) -> Iterator[None]:
    """Once a worker opened the FIFO to build the tokenizer: it waits for its bytes (holding its
    GIL) until the block ends, which writes them."""
    began = time.monotonic()
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: no reader yet
                raise
            assert time.monotonic() - began < _WAIT_S, "no worker began to build"
            time.sleep(0.05)
    try:
        yield
    finally:
        os.set_blocking(fd, True)
        with contextlib.suppress(BrokenPipeError):
            os.write(fd, _TOKENIZER)
        os.close(fd)


def _answers(url: str, pool: ThreadPoolExecutor, count: int = 8) -> tuple[dict[int, str], Held]:
    """`count` requests at once, each on a new connection (a chat, or a readiness check), all
    but one answered now: the pid and policy version of each worker that answered, and the
    requests left. (A worker frozen in a build may have taken one connection from the listening
    socket as it froze, as uvloop accepts before it calls Python: it answers once built.)"""
    sent = [pool.submit(_readiness if n % 2 else _chatted, url) for n in range(count)]
    began = time.monotonic()
    while sum(answer.done() for answer in sent) < count - 1:
        assert time.monotonic() - began < _WAIT_S, "requests wait for the worker that builds"
        time.sleep(0.05)
    seen = dict(answer.result() for answer in sent if answer.done() and answer.result())
    return seen, [answer for answer in sent if not answer.done()]


def _answered_at_last(held: Held) -> None:
    for answer in held:
        answer.result(timeout=_WAIT_S)


def _chatted(url: str) -> None:
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=_WAIT_S) as fresh:
        chat = fresh.post(url + "/v1/chat/completions", json=CHAT, headers=headers)
    assert chat.status_code == 200, chat.text


def _readiness(url: str) -> tuple[int, str]:
    with httpx.Client(timeout=_WAIT_S) as fresh:
        ready = fresh.get(url + "/readyz?backends=skip").json()
    return ready["pid"], ready["policy_hash"]


def _eventually_serving(url: str, version: str) -> None:
    """Until a worker says it serves `version` (a request the other worker took while it began
    to build may wait for the build: a short timeout, asked again)."""
    began = time.monotonic()
    while True:
        with contextlib.suppress(httpx.TransportError), httpx.Client(timeout=2) as fresh:
            if fresh.get(url + "/readyz?backends=skip").json()["policy_hash"] == version:
                return
        assert time.monotonic() - began < _WAIT_S, f"no worker serves {version}"
        time.sleep(0.1)
