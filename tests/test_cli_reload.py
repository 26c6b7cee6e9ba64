"""`tokenweir serve` reloads its policy file on SIGHUP, with --watch, and in every worker."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.servers import free_port, wait_healthy
from tests.test_reload import (
    ADMIN,
    CHAT,
    NEW_KEY,
    OLD_KEY,
    STAY_KEY,
    policy_text,
)

_WAIT_S = 30.0


@contextmanager
def tokenweir_serve(
    config: Path, *options: str, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    log = config.with_suffix(".log").open("wb")
    command = [sys.executable, "-m", "proxy", "serve", "--config", str(config)]
    process = subprocess.Popen(
        [*command, "--port", str(port), "--no-access-log", *options], stderr=log, env=env
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process)
        yield process, url
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.close()


def _chat(url: str, key: str) -> int:
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(url + "/v1/chat/completions", json=CHAT, headers=headers).status_code


def _eventually(check: Callable[[], bool]) -> float:
    began = time.monotonic()
    while not check():
        assert time.monotonic() - began < _WAIT_S, "not within the wait"
        time.sleep(0.1)
    return time.monotonic() - began


def _ready(url: str) -> dict[str, object]:
    with httpx.Client() as fresh:  # a new connection: under --workers, any worker may answer
        answer: dict[str, object] = fresh.get(url + "/readyz").json()
    return answer


def _reloads(url: str) -> dict[str, float]:
    """`tokenweir_policy_reloads_total` on `/metrics`, by result."""
    found = re.findall(
        r'^tokenweir_policy_reloads_total\{result="(\w+)"\} (\S+)$',
        httpx.get(url + "/metrics").text,
        re.MULTILINE,
    )
    return {result: float(value) for result, value in found}


def test_sighup_reloads_a_running_serve(backend_url: str, tmp_path: Path) -> None:
    config = tmp_path / "policy.yaml"
    config.write_text(policy_text(backend_url))
    with tokenweir_serve(config) as (process, url):
        before = _ready(url)["policy_hash"]
        config.write_text(policy_text(backend_url, newcomer=True))
        assert _chat(url, NEW_KEY) == 401
        process.send_signal(signal.SIGHUP)
        _eventually(lambda: _chat(url, NEW_KEY) == 200)
        assert _ready(url)["policy_hash"] != before
        assert process.poll() is None


def test_watch_reloads_on_change_and_refuses_a_broken_file(
    backend_url: str, tmp_path: Path
) -> None:
    config = tmp_path / "policy.yaml"
    config.write_text(policy_text(backend_url))
    with tokenweir_serve(config, "--watch") as (_, url):
        config.write_text(policy_text(backend_url, newcomer=True))
        _eventually(lambda: _chat(url, NEW_KEY) == 200)
        serving = _ready(url)["policy_hash"]
        assert _reloads(url) == {"applied": 1}
        config.write_text("tenants: [not, a, mapping\n")
        log = config.with_suffix(".log")
        _eventually(lambda: b"refused" in log.read_bytes())
        assert _chat(url, NEW_KEY) == 200
        assert _chat(url, STAY_KEY) == 200
        assert _ready(url)["policy_hash"] == serving
        assert _reloads(url) == {"applied": 1, "refused": 1}  # an alert can watch this
    assert f"{config}:".encode() in log.read_bytes()  # the line-numbered problem is logged


def test_every_worker_reloads_on_sighup_and_on_the_admin_route(
    backend_url: str, redis_url: str, tmp_path: Path
) -> None:
    def on_redis(text: str) -> str:  # several workers need shared storage
        return text.replace("storage: memory", f"storage: {redis_url}")

    config = tmp_path / "policy.yaml"
    config.write_text(on_redis(policy_text(backend_url)))
    with tokenweir_serve(config, "--workers", "2") as (process, url):
        seen: dict[object, object] = {}

        def both_serve(digest: object) -> bool:
            ready = _ready(url)
            seen[ready["pid"]] = ready["policy_hash"]
            return len(seen) == 2 and set(seen.values()) == {digest}

        first = _ready(url)["policy_hash"]
        _eventually(lambda: both_serve(first))
        workers = set(seen)
        config.write_text(on_redis(policy_text(backend_url, newcomer=True)))
        second = _digest(config)
        os.kill(process.pid, signal.SIGHUP)
        _eventually(lambda: both_serve(second))
        config.write_text(on_redis(policy_text(backend_url, newcomer=True, leaked_key=False)))
        reloaded = httpx.post(url + "/admin/reload", headers=ADMIN).json()
        _eventually(lambda: both_serve(reloaded["policy_hash"]))
        assert set(seen) == workers  # reloaded in place, not restarted
        assert len({first, second, reloaded["policy_hash"]}) == 3


def test_an_admin_reload_answers_once_every_worker_serves_the_file(
    backend_url: str, redis_url: str, tmp_path: Path
) -> None:
    """`POST /admin/reload` under `--workers 2`: a worker that found nothing new (a SIGHUP sent to
    its pid alone, as /readyz names it) answered `unchanged` and told no one, so the other served
    a key the file had removed for good; and a reload that changed answered before the other
    worker had it. Now the answer comes once every worker serves the file."""

    def on_redis(text: str) -> str:
        return text.replace("storage: memory", f"storage: {redis_url}")

    config = tmp_path / "policy.yaml"
    config.write_text(on_redis(policy_text(backend_url)))
    with tokenweir_serve(config, "--workers", "2") as (_, url):
        pids: set[object] = set()

        def both_answered() -> bool:
            pids.add(_ready(url)["pid"])
            return len(pids) == 2

        _eventually(both_answered)
        config.write_text(on_redis(policy_text(backend_url, leaked_key=False)))
        removed = _digest(config)
        with _connection_to_a_worker(url) as (alone, http):
            os.kill(alone, signal.SIGHUP)  # this worker alone reloads
            _eventually(lambda: http.get("/readyz").json()["policy_hash"] == removed)
            answer = http.post("/admin/reload", headers=ADMIN).json()
        assert answer["status"] == "unchanged"
        assert _every_worker(url) == {(removed, 401)}  # the leaked key, whichever worker answers
        config.write_text(on_redis(policy_text(backend_url, leaked_key=False, newcomer=True)))
        answer = httpx.post(url + "/admin/reload", headers=ADMIN).json()
        assert answer["status"] == "reloaded"
        assert answer["policy_hash"] == _digest(config)
        assert _every_worker(url) == {(_digest(config), 401)}


@contextmanager
def _connection_to_a_worker(url: str) -> Iterator[tuple[int, httpx.Client]]:
    """A keep-alive connection, and the pid of the worker that took it."""
    with httpx.Client(base_url=url) as http:
        yield int(http.get("/readyz").json()["pid"]), http


def _every_worker(url: str) -> set[tuple[object, int]]:
    """Asked on new connections until both workers answered (at once: no waiting between): the
    policy version each serves, and the leaked key's status there."""
    found: dict[int, tuple[object, int]] = {}
    began = time.monotonic()
    while len(found) < 2:
        assert time.monotonic() - began < _WAIT_S, f"one worker answered: {found}"
        with httpx.Client(base_url=url) as http:
            ready = http.get("/readyz").json()
            leaked = {"authorization": f"Bearer {OLD_KEY}"}
            chat = http.post("/v1/chat/completions", json=CHAT, headers=leaked)
        found.setdefault(int(ready["pid"]), (ready["policy_hash"], chat.status_code))
    return set(found.values())


def _digest(config: Path) -> str:
    return hashlib.sha256(config.read_bytes()).hexdigest()[:16]


def test_a_tokenizer_that_cannot_load_is_refused_and_the_watcher_goes_on(
    backend_url: str, tmp_path: Path
) -> None:
    """A file the checker accepts but whose tokenizer is missing: the watcher, SIGHUP and the
    admin route each refuse it with the documented log line; a later good edit still applies."""
    config = tmp_path / "policy.yaml"
    config.write_text(policy_text(backend_url))
    log = config.with_suffix(".log")
    missing = "models: {mock-llm: {tokenizer: /nonexistent/tokenizer.json}}"
    with tokenweir_serve(config, "--watch") as (process, url):
        serving = _ready(url)["policy_hash"]
        newcomer = policy_text(backend_url, newcomer=True)
        config.write_text(newcomer.replace("models: {mock-llm: {}}", missing))
        _eventually(lambda: b"policy reload (file changed) refused" in log.read_bytes())
        process.send_signal(signal.SIGHUP)
        _eventually(lambda: b"policy reload (SIGHUP) refused" in log.read_bytes())
        refused = httpx.post(url + "/admin/reload", headers=ADMIN)
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "invalid_policy"
        assert _chat(url, NEW_KEY) == 401
        assert _ready(url)["policy_hash"] == serving
        config.write_text(newcomer)  # fixed: the watcher is still there to apply it
        _eventually(lambda: _chat(url, NEW_KEY) == 200)
        assert process.poll() is None
    written = log.read_bytes()
    assert b"tokenizer '/nonexistent/tokenizer.json'" in written
    assert b"never retrieved" not in written


class _SilentRedis:
    """A port where the gateway's Redis should be: it takes connections and answers nothing, so
    a gateway starting up waits there (in its lifespan, before the reloader takes SIGHUP) until
    `release` closes everything; the gateway then starts without storage."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self._listener.getsockname()[1]}/0"
        self.connected = threading.Event()
        self._held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return  # released
            self._held.append(connection)
            self.connected.set()

    def release(self) -> None:
        self._listener.close()
        self._thread.join(10)
        for connection in self._held:
            connection.close()


@contextmanager
def _serving_on_silent_redis(
    config: Path, redis: _SilentRedis, *args: str
) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    """`tokenweir serve` on `config` (its startup waiting on `redis` until released): the
    process, its URL and its log; stopped, and the Redis released, at the end."""
    port = free_port()
    log_path = config.with_suffix(".log")
    command = [sys.executable, "-m", "proxy", "serve", "--config", str(config), "--port"]
    with log_path.open("wb") as log:
        process = subprocess.Popen([*command, str(port), *args, "--no-access-log"], stderr=log)
        try:
            yield process, f"http://127.0.0.1:{port}", log_path
        finally:
            redis.release()
            process.terminate()
            process.wait(timeout=60)


def test_sighup_while_serve_starts_neither_kills_it_nor_is_lost(
    backend_url: str, tmp_path: Path
) -> None:
    """SIGHUP before the reloader is in place (here: while startup waits for Redis) used to end
    the process (SIGHUP's default action); it is held, and reloads once the gateway is up."""
    redis = _SilentRedis()
    config = tmp_path / "policy.yaml"

    def on_redis(text: str) -> str:
        return text.replace("storage: memory", f"storage: {redis.url}")

    config.write_text(on_redis(policy_text(backend_url)))
    with _serving_on_silent_redis(config, redis) as (process, url, _):
        assert redis.connected.wait(120), "the gateway never reached its storage"
        config.write_text(on_redis(policy_text(backend_url, newcomer=True)))  # read already
        process.send_signal(signal.SIGHUP)
        redis.release()
        wait_healthy(url, process)
        _eventually(lambda: _chat(url, NEW_KEY) == 200)  # the held SIGHUP reloaded it
        assert process.poll() is None


def test_a_worker_starting_when_sighup_is_forwarded_survives_it(
    backend_url: str, tmp_path: Path
) -> None:
    """The supervisor forwards SIGHUP to every worker, including one still starting: it is held
    there until that worker's reloader takes it, instead of killing (and restarting) it."""
    redis = _SilentRedis()
    config = tmp_path / "policy.yaml"
    config.write_text(policy_text(backend_url).replace("storage: memory", f"storage: {redis.url}"))
    with _serving_on_silent_redis(config, redis, "--workers", "2") as (process, url, log_path):
        assert redis.connected.wait(120), "no worker reached its storage"
        process.send_signal(signal.SIGHUP)  # forwarded within half a second
        _eventually(lambda: b"Received SIGHUP, reloading" in log_path.read_bytes())
        redis.release()
        wait_healthy(url, process)
        pids: set[object] = set()

        def both_answer() -> bool:
            pids.add(_ready(url)["pid"])
            return len(pids) == 2

        _eventually(both_answer)
        assert process.poll() is None
    assert b"died" not in log_path.read_bytes()


def test_a_worker_started_again_serves_the_policy_its_siblings_serve(
    backend_url: str, redis_url: str, tmp_path: Path
) -> None:
    """A file every worker refused (here its tokenizer cannot load) stays on disk; a worker that
    dies and is started again serves the policy the others serve, not that file: it used to fail
    to start, and the supervisor then stopped the whole server (exit code 3)."""

    def on_redis(text: str) -> str:
        return text.replace("storage: memory", f"storage: {redis_url}")

    config = tmp_path / "policy.yaml"
    config.write_text(on_redis(policy_text(backend_url)))
    log = config.with_suffix(".log")
    with tokenweir_serve(config, "--workers", "2") as (process, url):
        serving = _ready(url)["policy_hash"]
        pids: set[object] = set()

        def both_answered() -> bool:
            pids.add(_ready(url)["pid"])
            return len(pids) == 2

        _eventually(both_answered)
        missing = "models: {mock-llm: {tokenizer: /nonexistent/tokenizer.json}}"
        newcomer = on_redis(policy_text(backend_url, newcomer=True))
        config.write_text(newcomer.replace("models: {mock-llm: {}}", missing))
        os.kill(process.pid, signal.SIGHUP)
        _eventually(lambda: log.read_bytes().count(b"policy reload (SIGHUP) refused") == 2)
        killed = pids.pop()
        assert isinstance(killed, int)
        os.kill(killed, signal.SIGKILL)
        answering: set[object] = set()

        def restarted_serves() -> bool:
            assert process.poll() is None, "the server stopped"
            try:
                ready = _ready(url)
            except httpx.TransportError:  # a connection the killed worker had taken
                return False
            assert ready["policy_hash"] == serving
            answering.add(ready["pid"])
            return len(answering - {killed} - pids) == 1

        _eventually(restarted_serves)
        for _ in range(6):  # whichever worker answers: the policy they all serve
            assert _chat(url, NEW_KEY) == 401
            assert _chat(url, STAY_KEY) == 200
    written = log.read_bytes()
    assert b"failed to start" not in written
    assert b"is not the policy the other workers serve" in written  # the started one says so


def test_the_watcher_sees_a_change_made_while_serve_starts(
    backend_url: str, tmp_path: Path
) -> None:
    """A file saved after `serve --watch` read it but before its watcher began (here: while
    startup waits for Redis; a tokenizer downloading is another such wait) is applied: the
    watcher took the file as it was then for the one it serves, and never reloaded it."""
    redis = _SilentRedis()
    config = tmp_path / "policy.yaml"

    def on_redis(text: str) -> str:
        return text.replace("storage: memory", f"storage: {redis.url}")

    config.write_text(on_redis(policy_text(backend_url)))
    with _serving_on_silent_redis(config, redis, "--watch") as (process, url, _):
        assert redis.connected.wait(120), "the gateway never reached its storage"
        config.write_text(on_redis(policy_text(backend_url, newcomer=True)))  # read already
        redis.release()
        wait_healthy(url, process)
        _eventually(lambda: _chat(url, NEW_KEY) == 200)
        assert _ready(url)["policy_hash"] == _digest(config)


def test_the_watcher_waits_for_a_file_being_written_to_hold_still(
    backend_url: str, tmp_path: Path
) -> None:
    """A file written in pieces over a few seconds (a slow copy, a script writing as it goes):
    the watcher reloads it once it holds still, not a piece of it. It used to apply what it
    found mid-way, here a policy without the last tenant, and that reload revoked the tenant's
    runtime keys for good."""
    config = tmp_path / "policy.yaml"
    text = policy_text(backend_url, newcomer=True)
    config.write_text(text)
    head, tail = text.split("  gamma:")
    with tokenweir_serve(config, "--watch") as (_, url):
        created = httpx.post(url + "/admin/keys", json={"tenant": "gamma"}, headers=ADMIN)
        key = created.json()["key"]
        assert _chat(url, key) == 200
        with config.open("w") as writing:
            writing.write(head)
            for line in range(60):  # three seconds of a valid file without gamma, growing
                writing.write(f"    # line {line}\n")
                writing.flush()
                time.sleep(0.05)
            writing.write("  gamma:" + tail)
        _eventually(lambda: _ready(url)["policy_hash"] == _digest(config))
        assert _chat(url, key) == 200
        assert _chat(url, NEW_KEY) == 200
    assert b"revoked" not in config.with_suffix(".log").read_bytes()
