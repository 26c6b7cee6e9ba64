"""A private redis-server on a free 127.0.0.1 port for ledger tests; nothing saved to disk."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import redis

__all__ = ["RedisProcess", "free_port"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RedisProcess:
    """`redis-server --port <port> --save "" --appendonly no`, started and stopped by the test."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self._process: subprocess.Popen[bytes] | None = None

    @staticmethod
    def available() -> bool:
        return shutil.which("redis-server") is not None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> RedisProcess:
        command = ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port)]
        command += ["--save", "", "--appendonly", "no"]
        self._process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout_s
        with redis.Redis(port=self.port, socket_connect_timeout=1) as client:
            while True:
                try:
                    client.ping()
                    return self
                except redis.ConnectionError:
                    if self._process.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(f"redis-server did not start on {self.port}") from None
                    time.sleep(0.02)

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=10)
            self._process = None
