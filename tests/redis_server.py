"""Private redis-servers on free 127.0.0.1 ports, for tests that need real Redis."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from tests.certs import self_signed
from tests.servers import free_port


class RedisProcess:
    """A redis-server (no persistence) that a test may stop and start again on the same port;
    `args` are more redis-server options (`--replicaof`, say)."""

    def __init__(self, args: Sequence[str] = ()) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail(
                "redis-server is not installed: tests need real Redis (apt-get install redis)"
            )
        self._binary = binary
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._args = list(args)
        self._workdir = tempfile.TemporaryDirectory()
        self._server: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # DEBUG SLEEP, from 127.0.0.1 only, lets a test make this Redis slow.
        with open(self._log_path, "ab") as log:
            self._server = subprocess.Popen(
                [self._binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", self._workdir.name,
                 "--enable-debug-command", "local", *self._args],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            self._wait_ready()
        except BaseException:
            self.kill()  # a server that never answered is not left running
            raise

    def kill(self) -> None:
        """SIGKILL: no shutdown, as when a host dies."""
        if self._server is not None:
            self._server.kill()
            self._server.wait(timeout=10)
            self._server = None

    def pause(self) -> None:
        """SIGSTOP: the server takes connections (the kernel does) and reads nothing, as a host
        that hangs; what is written to it waits in its sockets, run on `resume`, lost on `kill`."""
        if self._server is not None:
            os.kill(self._server.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self._server is not None:
            os.kill(self._server.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self._server is not None:
            self._server.terminate()
            self._server.wait(timeout=10)
            self._server = None

    def close(self) -> None:
        self.stop()
        self._workdir.cleanup()

    @property
    def _log_path(self) -> Path:
        return Path(self._workdir.name) / "redis.log"

    def _log_tail(self) -> str:
        """The server's last words, for a failure message (a port in use, say)."""
        try:
            lines = self._log_path.read_text(errors="replace")
        except OSError:
            return "no log"
        return " | ".join(lines.strip().splitlines()[-3:]) or "an empty log"

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
                        raise RuntimeError(
                            f"redis-server on port {self.port} did not start: {self._log_tail()}"
                        ) from None
                    time.sleep(0.02)


def listening_on(unix_socket: Path) -> list[str]:
    """redis-server's arguments to listen on `unix_socket` as well, for this user only."""
    return ["--unixsocket", str(unix_socket), "--unixsocketperm", "700"]


@contextmanager
def private_redis(unix_socket: Path | None = None) -> Iterator[str]:
    """Start redis-server (no persistence) and yield its URL; stop it afterwards. With
    `unix_socket`, it listens there too and the URL is that socket's (unix://)."""
    server = RedisProcess([] if unix_socket is None else listening_on(unix_socket))
    try:
        server.start()
        yield server.url if unix_socket is None else f"unix://{unix_socket}?db=0"
    finally:
        server.close()


@contextmanager
def tls_redis(directory: Path) -> Iterator[tuple[RedisProcess, str]]:
    """A redis-server that also speaks TLS, on a second port, with a self-signed certificate
    made in `directory`. Yields the server (its `url` is the plain port) and a rediss:// URL
    that trusts that certificate."""
    cert, key = self_signed(directory)
    port = free_port()
    server = RedisProcess(
        ["--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
         "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"]
    )  # fmt: skip
    try:
        server.start()
        yield server, f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}"
    finally:
        server.close()


@contextmanager
def frozen(url: str, seconds: int) -> Iterator[None]:
    """Redis busy for `seconds` (`DEBUG SLEEP`, as under a slow script): it accepts connections
    but answers nothing. Yields once it is frozen; returns once it answers again."""
    with redis.Redis.from_url(url, socket_timeout=seconds + 10) as sleeper:
        sleeping = threading.Thread(
            target=sleeper.execute_command, args=("DEBUG", "SLEEP", seconds)
        )
        sleeping.start()
        try:
            _wait_frozen(url)
            yield
        finally:
            sleeping.join()


def _wait_frozen(url: str) -> None:
    deadline = time.monotonic() + 5
    with redis.Redis.from_url(url, socket_timeout=0.1) as probe:
        while time.monotonic() < deadline:
            try:
                probe.ping()
            except redis.TimeoutError:
                return
            time.sleep(0.01)
    raise AssertionError("redis did not freeze")


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Until `check()` holds (a refused connection counts as not yet), or AssertionError."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except redis.ConnectionError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not ready within {timeout_s} s")
        time.sleep(0.05)
