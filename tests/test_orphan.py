"""`tokenweir serve --workers N` whose supervisor is killed (SIGKILL: an operator's `kill -9`, a
process manager that kills only the main PID): its workers drain and exit, freeing the port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from proxy.telemetry.workershare import METRICS_DIR_ENV
from tests.redis_server import private_redis
from tests.reliability.state import AUTH, policy_text
from tests.test_cli_reload import tokenweir_serve

_WAIT_S = 60.0  # a limit on a loaded 2-core machine, not a measurement
STREAM = {
    "model": "mock-llm",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "mock_completion_tokens": 6000,  # 3 s at the mock's 2,000 tokens/s
}


def _workers_of(supervisor: int) -> set[int]:
    """The worker processes `supervisor` started (not multiprocessing's resource tracker)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rpartition(")")[2].split()[1])
        if parent == supervisor and b"spawn_main" in command:
            found.add(int(entry.name))
    return found


def _metrics_dir(worker: int) -> Path:
    """The directory the supervisor made for its workers' metrics, from a worker's environment."""
    environ = (Path("/proc") / str(worker) / "environ").read_bytes().split(b"\0")
    wanted = METRICS_DIR_ENV.encode() + b"="
    return Path(next(v for v in environ if v.startswith(wanted))[len(wanted) :].decode())


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _stream_last_line(url: str, started: threading.Event, lines: list[str]) -> None:
    with httpx.stream("POST", url + "/v1/chat/completions", json=STREAM, headers=AUTH,
                      timeout=_WAIT_S) as answer:  # fmt: skip
        for line in answer.iter_lines():
            if line:
                lines.append(line)
                started.set()


def test_workers_drain_and_exit_when_their_supervisor_is_killed(
    backend_url: str, tmp_path: Path
) -> None:
    with private_redis() as redis_url:
        config = tmp_path / "policy.yaml"
        config.write_text(policy_text(backend_url, redis_url, server="{drain_timeout: 30s}"))
        with tokenweir_serve(config, "--workers", "2") as (process, url):
            began = time.monotonic()
            while len(workers := _workers_of(process.pid)) < 2:
                assert time.monotonic() - began < _WAIT_S, "the workers did not start"
                time.sleep(0.1)
            metrics_dir = _metrics_dir(min(workers))
            assert metrics_dir.is_dir()
            started, lines = threading.Event(), []  # type: tuple[threading.Event, list[str]]
            streaming = threading.Thread(target=_stream_last_line, args=(url, started, lines))
            streaming.start()
            assert started.wait(_WAIT_S)
            process.kill()
            process.wait(timeout=10)
            try:
                streaming.join(_WAIT_S)
                began = time.monotonic()
                while any(_alive(pid) for pid in workers):
                    assert time.monotonic() - began < _WAIT_S, "orphaned workers still serve"
                    time.sleep(0.1)
            finally:  # none left behind if they did not go
                for pid in filter(_alive, workers):
                    os.kill(pid, signal.SIGKILL)
        assert lines[-1] == "data: [DONE]"  # the stream in flight was drained, not cut
        assert not metrics_dir.exists()  # the last worker out removed it: no one else would
        port = int(url.rpartition(":")[2])
        with socket.socket() as again:  # a new `tokenweir serve` can take the port
            again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            again.bind(("127.0.0.1", port))


def test_a_worker_whose_supervisor_died_while_it_started_exits_at_once() -> None:
    # The pid given is not the child's parent: as if the supervisor died before the call.
    code = (
        "import os, time; from proxy.orphan import end_with_supervisor; "
        "assert end_with_supervisor(os.getppid() + 1_000_000); time.sleep(60)"
    )
    child = subprocess.run([sys.executable, "-c", code], timeout=_WAIT_S, check=False)
    assert child.returncode == -signal.SIGTERM


def test_one_process_serve_with_an_inherited_supervisor_pid_keeps_serving(
    backend_url: str, tmp_path: Path
) -> None:
    """One `serve` started from a worker's environment is no worker: it does not take the pid
    it inherited for a supervisor gone, and serves on."""
    config = tmp_path / "policy.yaml"
    config.write_text(policy_text(backend_url, "memory"))
    env = {**os.environ, "TOKENWEIR_SUPERVISOR_PID": "999999999"}  # not serve's parent
    with tokenweir_serve(config, env=env) as (process, url):
        time.sleep(1)  # a worker that took itself for an orphan would be draining by now
        assert httpx.get(url + "/healthz").status_code == 200
        assert process.poll() is None
