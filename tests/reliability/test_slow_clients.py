"""Clients that stop reading their answers, over raw sockets to a real `tokenweir serve`, in front
of a backend that sends as fast as the gateway takes: the gateway pushes back on the backend,
holds little of each stream, however many such clients it has, and lets go of an answer its
client does not read within the stall timeout."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from proxy.policy.units import hash_key
from tests.servers import replicas
from tests.upstream.hostile import CHAT, CHUNK, HostileBackend, Writer, event, head, json_answer

KEY = "tw-slow-clients"
STREAMS = 100
TEXT = "x" * 8000  # events of about 8 KiB
# What each stream must have sent before its client's socket, the gateway's socket buffers
# towards both (a few MiB on loopback) and the gateway's own buffer are all full.
FILLED_BYTES = 24 << 20
# A hundred such streams took the gateway 161 MiB when it buffered a MiB of each (and wrote as much
# to each client's socket at once); 58 MiB with 64 KiB (a stream's own objects and a read or two).
GROWTH_BOUND_BYTES = 100 << 20
BIG = "y" * 8_000_000
LONG_BYTES = 24 << 20


async def flood(server: HostileBackend, writer: Writer, request: dict[str, Any]) -> None:
    """A stream of big events, as fast as the gateway reads them, until it hangs up (or 60 s)."""
    name = f"flood-{request['tag']}"
    data = head("200 OK", "content-type: text/event-stream", "transfer-encoding: chunked")
    await server.send(name, writer, data + _chunk(event(CHUNK)))
    big = _chunk(event({**CHUNK, "choices": [{"index": 0, "delta": {"content": TEXT}}]}))
    give_up_at_s = asyncio.get_running_loop().time() + 60
    while not server.stop.is_set() and asyncio.get_running_loop().time() < give_up_at_s:
        await server.send(name, writer, big)
    writer.transport.abort()


async def big_whole(server: HostileBackend, writer: Writer, request: dict[str, Any]) -> None:
    """A whole answer of 8 MB: under the gateway's cap, far more than sockets buffer."""
    answer = {**CHAT, "choices": [{"index": 0, "message": {"role": "assistant", "content": BIG}}]}
    body = orjson.dumps(answer)
    await server.send("big_whole", writer, json_answer("200 OK", body) + body)


async def long_stream(server: HostileBackend, writer: Writer, request: dict[str, Any]) -> None:
    """A stream of LONG_BYTES and its end, as fast as the gateway reads it: well within the
    total timeout for a client that keeps up."""
    name = f"flood-{request['tag']}"
    data = head("200 OK", "content-type: text/event-stream", "transfer-encoding: chunked")
    await server.send(name, writer, data + _chunk(event(CHUNK)))
    big = _chunk(event({**CHUNK, "choices": [{"index": 0, "delta": {"content": TEXT}}]}))
    while server.sent_bytes[name] < LONG_BYTES:
        await server.send(name, writer, big)
    await server.send(name, writer, _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


@pytest.fixture(scope="module")
def backend() -> Iterator[HostileBackend]:
    extra = {"flood": flood, "big_whole": big_whole, "long_stream": long_stream}
    with HostileBackend(extra) as backend:
        yield backend


@contextlib.contextmanager
def _gateway(
    backend: HostileBackend, directory: Path, server: str, upstream: str = "{probe_interval: 0}"
) -> Iterator[tuple[int, int, HostileBackend]]:
    """Its port and pid, and its backend."""
    config = directory / "policy.yaml"
    config.write_text(f"""
storage: memory
server: {server}
upstream: {upstream}
backends: [{{name: flood, url: "{backend.url}/v1", models: [flood-llm]}}]
models: {{flood-llm: {{}}}}
tenants:
  app:
    api_keys: [{hash_key(KEY)}]
    models: [flood-llm]
    limits: {{max_concurrent: 1000}}
""")
    with replicas(config, 1) as [(process, url)]:
        yield int(url.rsplit(":", 1)[1]), process.pid, backend


@pytest.fixture(scope="module")
def gateway(
    backend: HostileBackend, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[int, int, HostileBackend]]:
    """Stalled clients are not cut off while a test measures them."""
    with _gateway(backend, tmp_path_factory.mktemp("slow"), "{body_timeout: 120s}") as served:
        yield served


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


def _stalled_stream(
    port: int, tag: str, hostile: str = "flood", buffer_bytes: int = 4096
) -> socket.socket:
    """A client that asks for a stream (or a whole answer) and reads none of it (a tiny receive
    buffer)."""
    body = orjson.dumps(
        {"model": "flood-llm", "messages": [{"role": "user", "content": "hi"}]}
        | {"stream": hostile != "big_whole", "hostile": hostile, "tag": tag}
    )
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
    sock.connect(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer %b\r\ncontent-length: %d\r\n\r\n%b"
        % (KEY.encode(), len(body), body)
    )
    return sock


def test_clients_that_stop_reading_cost_the_gateway_little_each(
    gateway: tuple[int, int, HostileBackend],
) -> None:
    """The gateway read on from the backend of a client that stopped reading until it held a MiB
    of the stream, then wrote all of it to the client's socket buffer at once: 1.6 MiB a stream,
    so a thousand such clients took gigabytes. It now stops reading past 64 KiB, and the
    backend, its socket full, waits (backpressure)."""
    port, pid, backend = gateway
    warm = [_stalled_stream(port, f"warm-{i}") for i in range(4)]
    _wait_filled(backend, [f"warm-{i}" for i in range(4)])
    for sock in warm:
        sock.close()
    time.sleep(1)
    before = _rss_bytes(pid)
    tags = [str(i) for i in range(STREAMS)]
    clients = [_stalled_stream(port, tag) for tag in tags]
    try:
        peak = _wait_filled(backend, tags, pid)
    finally:
        for sock in clients:
            sock.close()
    growth = peak - before
    assert growth < GROWTH_BOUND_BYTES, f"{STREAMS} stalled streams took {growth / 2**20:.0f} MiB"


def _wait_filled(backend: HostileBackend, tags: list[str], pid: int = 0) -> int:
    """Wait until each stream's backend sent FILLED_BYTES, or sent nothing more for 3 s (pushed
    back); the gateway's peak RSS meanwhile (with a pid)."""
    peak = 0
    deadline = time.monotonic() + 60
    last: list[int] = []
    still_since = time.monotonic()
    while time.monotonic() < deadline:
        if pid:
            peak = max(peak, _rss_bytes(pid))
        sent = [backend.sent_bytes.get(f"flood-{tag}", 0) for tag in tags]
        if min(sent) >= FILLED_BYTES:
            break
        if sent != last:
            last, still_since = sent, time.monotonic()
        elif time.monotonic() - still_since > 3 and min(sent) > 0:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the streams did not fill in 60 s: {sorted(last)[:5]} bytes sent")
    return max(peak, _rss_bytes(pid)) if pid else 0


def test_a_whole_answer_its_client_does_not_read_is_let_go_at_the_stall_timeout(
    backend: HostileBackend, tmp_path: Path
) -> None:
    """A whole answer written to a client that read none of it stayed in the gateway's memory
    for as long as the client kept its connection open (up to 32 MiB a connection, ten such
    clients of 20 MB answers: 380 MiB): the keep-alive timeout's close waits for the client to
    read what is buffered, and the stall timeout gave up on a closing connection. It is now cut
    off at the stall timeout (`server.body_timeout`), closing or not."""
    server = "{body_timeout: 2s, keep_alive_timeout: 1s}"
    with _gateway(backend, tmp_path, server) as (port, _, _):
        clients = [_stalled_stream(port, f"whole-{i}", "big_whole") for i in range(4)]
        try:
            deadline = time.monotonic() + 30
            while _served_connections(port):
                assert time.monotonic() < deadline, "an unread answer is held for ever"
                time.sleep(0.2)
        finally:
            for sock in clients:
                sock.close()


def test_a_client_that_reads_a_whole_answer_slowly_gets_all_of_it(
    backend: HostileBackend, tmp_path: Path
) -> None:
    """A whole answer drains below the transport's low-water mark only at its end: a client
    reading it steadily, if slowly, is not stalled and is not cut off at the stall timeout."""
    server = "{body_timeout: 2s, keep_alive_timeout: 1s}"
    with _gateway(backend, tmp_path, server) as (port, _, _):
        received = bytearray()
        with _stalled_stream(port, "slow-whole", "big_whole", buffer_bytes=65536) as sock:
            deadline = time.monotonic() + 90
            while len(received) < len(BIG):
                assert time.monotonic() < deadline, "the answer did not come"
                data = sock.recv(65536)
                assert data, f"cut off after {len(received)} bytes"
                received += data
                time.sleep(0.1)  # about 640 KB a second: 12 s for the answer
            head, _, body = bytes(received).partition(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            while len(body) < length:
                data = sock.recv(65536)
                assert data, f"cut off after {len(body)} of {length} bytes"
                body += data
        assert BIG.encode() in body


def _served_connections(port: int) -> int:
    """The gateway's established connections on `port`, as the kernel lists them (the clients'
    side would not show the gateway's reset until they read: a read would let it write on)."""
    local = f":{port:04X}"
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return sum(1 for row in rows if row[1].endswith(local) and row[3] == "01")


def test_a_stream_its_slow_client_made_outlast_the_total_timeout_is_not_the_backends_failure(
    backend: HostileBackend, tmp_path: Path
) -> None:
    """A client reading more slowly than the backend sends makes the gateway push back on the
    backend, so a stream that the backend would send in a second can outlast
    `upstream.total_timeout`. The cut is the documented one (an error event), but it was
    counted as the backend's failure: a tenant's slow readers opened a healthy backend's
    circuit, and every tenant got 503 `upstream_unavailable`. Such a stream now leaves no
    verdict on the backend."""
    upstream = "{total_timeout: 3s, probe_interval: 0, circuit: {failures: 1, open_for: 60s}}"
    with _gateway(backend, tmp_path, "{}", upstream) as (port, _, _):
        sock = _stalled_stream(port, "long", "long_stream", buffer_bytes=65536)
        received = bytearray()
        deadline = time.monotonic() + 90
        with sock:
            while not received.endswith(b"0\r\n\r\n"):
                assert time.monotonic() < deadline, "the slow stream did not end"
                received += sock.recv(65536)
                time.sleep(0.05)  # about a MB a second: slower than the backend
        assert b'"code":"upstream_timeout"' in received[-4096:]  # cut as documented
        body = {"model": "flood-llm", "messages": [{"role": "user", "content": "hi"}]}
        with httpx.Client(timeout=30) as client:
            answer = client.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json=body,
                headers={"authorization": f"Bearer {KEY}"},
            )
        assert answer.status_code == 200, answer.text  # the backend's circuit is closed
