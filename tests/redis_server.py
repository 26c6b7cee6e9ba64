"""Private redis-servers on free 127.0.0.1 ports, for tests that need real Redis."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class RedisProcess:
    """A redis-server (no persistence) that a test may stop and start again on the same port."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail(
                "redis-server is not installed: tests need real Redis (apt-get install redis)"
            )
        self._binary = binary
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._workdir = tempfile.TemporaryDirectory()
        self._server: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._server = subprocess.Popen(
            [self._binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self._workdir.name],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self._wait_ready()

    def stop(self) -> None:
        if self._server is not None:
            self._server.terminate()
            self._server.wait(timeout=10)
            self._server = None

    def close(self) -> None:
        self.stop()
        self._workdir.cleanup()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 10
        with redis.Redis.from_url(self.url, socket_connect_timeout=0.5) as client:
            while True:
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    exited = self._server is None or self._server.poll() is not None
                    if exited or time.monotonic() > deadline:
                        raise RuntimeError("redis-server did not start") from None
                    time.sleep(0.02)


@contextmanager
def private_redis() -> Iterator[str]:
    """Start redis-server (no persistence) and yield its URL; stop it afterwards."""
    server = RedisProcess()
    try:
        server.start()
        yield server.url
    finally:
        server.close()
