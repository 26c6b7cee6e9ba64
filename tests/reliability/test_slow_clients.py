"""Clients that stop reading their streams, over raw sockets to a real `tokenweir serve`, in front
of a backend that sends as fast as the gateway takes: the gateway pushes back on the backend and
holds little of each stream, however many such clients it has."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.policy.units import hash_key
from tests.servers import replicas
from tests.upstream.hostile import CHUNK, HostileBackend, Writer, event, head

KEY = "tw-slow-clients"
STREAMS = 100
TEXT = "x" * 8000  # events of about 8 KiB
# What each stream must have sent before its client's socket, the gateway's socket buffers
# towards both (a few MiB on loopback) and the gateway's own buffer are all full.
FILLED_BYTES = 24 << 20
# A hundred such streams took the gateway 161 MiB when it buffered a MiB of each (and wrote as much
# to each client's socket at once); 58 MiB with 64 KiB (a stream's own objects and a read or two).
GROWTH_BOUND_BYTES = 100 << 20


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


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int, HostileBackend]]:
    """Its port and pid, and its backend."""
    config = tmp_path_factory.mktemp("slow") / "policy.yaml"
    with HostileBackend({"flood": flood}) as backend:
        config.write_text(f"""
storage: memory
server: {{body_timeout: 120s}}
upstream: {{probe_interval: 0}}
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


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


def _stalled_stream(port: int, tag: str) -> socket.socket:
    """A client that asks for a stream and reads none of it (a tiny receive buffer)."""
    body = orjson.dumps(
        {"model": "flood-llm", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        | {"hostile": "flood", "tag": tag}
    )
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
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
