"""`tokenweir serve --watch` (one process, and `--workers 2`) on a policy file replaced by one far
past the size a policy file may hold: refused in the reload's one line, the old policy serving,
and the file never read past that size (a sparse 8 GiB file, the gateway's memory bounded)."""

from __future__ import annotations

import resource
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from proxy.policy.load import MAX_POLICY_BYTES
from tests.servers import free_port, wait_healthy
from tests.test_cli_reload import _chat, _digest, _eventually, _ready
from tests.test_cli_workers import _both_workers
from tests.test_reload import NEW_KEY, STAY_KEY, policy_text

_ADDRESS_SPACE = 3 << 30  # far more than a gateway needs; the sparse file read whole needs 8 GiB
_HUGE = 8 << 30


def _bounded() -> None:
    """In the gateway: a memory limit, so that reading the sparse file whole fails at once
    (MemoryError) rather than taking the test machine's memory."""
    resource.setrlimit(resource.RLIMIT_AS, (_ADDRESS_SPACE, _ADDRESS_SPACE))


@contextmanager
def bounded_serve(config: Path, *options: str) -> Iterator[str]:
    port = free_port()
    command = [sys.executable, "-m", "proxy", "serve", "--config", str(config), "--watch"]
    with config.with_suffix(".log").open("wb") as log:
        process = subprocess.Popen(
            [*command, "--port", str(port), "--no-access-log", *options], stderr=log,
            preexec_fn=_bounded,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, process)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:  # the old code's supervisor, dead in a traceback
                process.kill()
                process.wait()


def _replace(config: Path, make: str) -> None:
    """Put a new file in the policy's place in one rename, as an editor's save does."""
    new = config.with_name("policy.new")
    if make == "huge":
        with new.open("wb") as file:
            file.truncate(_HUGE)  # sparse: nothing to write, 8 GiB to read
    else:
        new.write_text(make)
    new.replace(config)


@pytest.mark.parametrize("workers", [1, 2])
def test_watch_refuses_a_huge_policy_file_unread_and_the_old_policy_serves(
    backend_url: str, redis_url: str, tmp_path: Path, workers: int
) -> None:
    """The watcher (and under --workers, the supervisor's rollout) read the whole file for its
    digest before the reload refused it: an 8 GiB file raised MemoryError in the watcher, which
    then watched no more (and under --workers took the supervisor down). Now each reader stops
    at the cap: the refusal is logged, the old policy serves, and a good file later applies."""
    config = tmp_path / "policy.yaml"
    storage = "storage: memory" if workers == 1 else f"storage: {redis_url}"
    text = policy_text(backend_url).replace("storage: memory", storage)
    config.write_text(text)
    log = config.with_suffix(".log")
    with bounded_serve(config, "--workers", str(workers)) as url:
        old = _digest(config)
        _replace(config, "huge")
        refused = f"{config}:0: more than {MAX_POLICY_BYTES >> 20} MiB"
        _eventually(lambda: log.read_text().count(refused) >= workers)
        assert _chat(url, STAY_KEY) == 200
        assert _chat(url, NEW_KEY) == 401
        if workers == 1:
            assert _ready(url)["policy_hash"] == old
        else:
            assert set(_both_workers(url).values()) == {old}
        _replace(
            config, policy_text(backend_url, newcomer=True).replace("storage: memory", storage)
        )
        _eventually(lambda: _chat(url, NEW_KEY) == 200)
        _eventually(lambda: _ready(url)["policy_hash"] == _digest(config))
    logged = log.read_text()
    assert "MemoryError" not in logged
    assert "Traceback" not in logged
