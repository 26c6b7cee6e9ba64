"""Run real ASGI servers on 127.0.0.1 for tests: uvicorn in a background thread, free port."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from starlette.types import ASGIApp

from proxy.tools.background import BackgroundServer


@contextmanager
def serve(
    app: ASGIApp, *, start_timeout_s: float = 10.0, tls: tuple[Path, Path] | None = None
) -> Iterator[str]:
    """Serve `app` on a free 127.0.0.1 port; yields its base URL, e.g. ``http://127.0.0.1:41234``
    (https with `tls`, a certificate and key: tests/certs.py)."""
    server = BackgroundServer(app, tls=tls)
    try:
        yield server.start(start_timeout_s)
    finally:
        server.stop()


def free_port() -> int:
    """A 127.0.0.1 port nothing listens on, for a server a test starts later.

    It comes from below the kernel's ephemeral range, never from `bind(0)`: a port from that
    range can be taken, before the server binds it, as the local port of any outgoing
    connection the suite makes (a CI run lost a cluster node that way). No port is handed out
    twice in one run: each pytest-xdist worker draws from a slice of the range of its own."""
    first, end = _worker_slice(_PORTS_FROM, _ephemeral_low())
    while True:
        port = _random.randrange(first, end)
        if port in _handed_out:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port


_PORTS_FROM = 20000
_handed_out: set[int] = set()
_random = random.Random()  # noqa: S311 (a port, not a secret)


def _worker_slice(first: int, end: int) -> tuple[int, int]:
    """Worker k of n's share of [first, end) (the whole of it outside pytest-xdist), so that two
    workers never probe, and then start a server on, the same port at once."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    size = (end - first) // max(count, 1)
    start = first + int(worker or 0) * size
    return start, start + size


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as lines:
            low = int(lines.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    return max(low, _PORTS_FROM + 1000)


def wait_healthy(
    url: str, process: subprocess.Popen[bytes], timeout_s: float = 120.0, path: str = "/healthz"
) -> None:
    """Wait until a gateway started as `process` answers `GET /healthz` (or `path`: a mock
    backend answers `/v1/models`); fail if it exits.

    A limit, not a measurement: on a loaded 2-core machine a fresh interpreter importing the
    gateway has taken over 30 s, and a gateway that cannot start still fails here."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + path).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if process.poll() is not None:
            stderr = process.stderr.read().decode(errors="replace") if process.stderr else ""
            raise AssertionError(f"the gateway exited: {stderr[-2000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} did not become healthy")
        time.sleep(0.05)


@contextmanager
def replicas(
    config: Path, count: int, *options: str, log: Path | None = None
) -> Iterator[list[tuple[subprocess.Popen[bytes], str]]]:
    """`count` `tokenweir serve` processes on one policy file, healthy; (process, URL) each;
    `options` go to each command line (`--workers 2`, say). Their stderr is read at the end,
    or goes to `log` (for a test whose gateways log more than a pipe holds while it runs)."""
    started: list[tuple[subprocess.Popen[bytes], str]] = []
    with contextlib.ExitStack() as files:
        stderr = files.enter_context(log.open("ab")) if log is not None else subprocess.PIPE
        try:
            for _ in range(count):
                port = free_port()
                command = [sys.executable, "-m", "proxy", "serve", "--config", str(config)]
                command += ["--port", str(port), "--no-access-log", *options]
                process = subprocess.Popen(command, stderr=stderr)
                started.append((process, f"http://127.0.0.1:{port}"))
            for process, url in started:
                wait_healthy(url, process)
            yield started
        finally:
            for process, _ in started:
                if process.poll() is None:
                    process.terminate()
            for process, _ in started:
                process.communicate(timeout=30)


def ready_workers(url: str, tries: int = 10) -> dict[int, str]:
    """Each worker that answers /readyz on a new connection (any worker may take one): its pid
    and the policy version it serves."""
    seen: dict[int, str] = {}
    for _ in range(tries):
        with httpx.Client() as fresh:
            ready = fresh.get(url + "/readyz?backends=skip").json()
        seen[ready["pid"]] = ready["policy_hash"]
    return seen


def told_to_send(client: socket.socket, authorization: str, length: int) -> None:
    """Send a chat request's head asking `Expect: 100-continue` for a body of `length` bytes on
    a raw connection, and wait for the 100 Continue: the gateway then has the request and waits
    for its body, which the caller sends as it likes."""
    client.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\n"
        b"authorization: " + authorization.encode() + b"\r\n"
        b"content-type: application/json\r\nexpect: 100-continue\r\n"
        b"content-length: %d\r\n\r\n" % length
    )
    assert client.recv(1024).startswith(b"HTTP/1.1 100 Continue")
