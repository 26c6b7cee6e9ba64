"""The transport to backends says when a request reached its backend whole (over http and https),
before any answer: a client that leaves then is billed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import anyio
import httpx
import pytest

from proxy.holds import Routed
from proxy.policy.model import Backend, CircuitSpec
from proxy.routing.health import BackendHealth
from proxy.upstream.transport import PooledTransport
from tests.certs import self_signed, server_tls
from tests.upstream.rawserver import RawServer, read_request


def _pooled() -> PooledTransport:
    return PooledTransport(
        connect_timeout_s=2.0,
        read_timeout_s=10.0,
        write_timeout_s=10.0,
        pool_timeout_s=2.0,
        max_connections=4,
    )


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
@pytest.mark.parametrize("scheme", ["http", "https"])
async def test_a_request_written_whole_is_marked_sent_before_any_answer(
    scheme: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tls = None
    if scheme == "https":
        cert, key = self_signed(tmp_path)
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        tls = server_tls(cert, key)
    answer = asyncio.Event()

    async def hold_the_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await answer.wait()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    backend = Backend(name="b", url="http://127.0.0.1:1/v1", models=("m",))
    routed = Routed("m", BackendHealth(backend, CircuitSpec()))
    sent = asyncio.Event()

    async def trace(event: str, info: dict[str, object]) -> None:
        await routed.trace(event, info)
        if routed.sent:
            sent.set()

    async with RawServer(hold_the_answer, tls) as raw, _pooled() as transport:
        request = httpx.Request("POST", raw.url, content=b'{"x": 1}')
        request.extensions["trace"] = trace
        request.extensions["timeout"] = {"connect": 2.0, "read": 10.0, "write": 10.0, "pool": 2.0}
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(transport.handle_async_request, request)
            with anyio.fail_after(10):
                await sent.wait()
            assert not answer.is_set()  # marked sent with no answer yet
            answer.set()


@pytest.mark.anyio
async def test_a_request_the_backend_dropped_on_a_stale_connection_is_not_sent() -> None:
    """A request written to a kept-alive connection the backend closes without a byte is sent
    again on a new connection: until that one has it, it is not sent. Here the new connection
    is refused: the mark said sent (the first write's), and a client that left then was
    billed its prompt for a request no backend took."""
    pooled = _pooled()

    async def stale_then_gone(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await read_request(reader)  # the second request, on the kept-alive connection
        raw.stop_listening()  # closed without an answer; the resend's connection is refused

    backend = Backend(name="b", url="http://127.0.0.1:1/v1", models=("m",))
    routed = Routed("m", BackendHealth(backend, CircuitSpec()))
    events: list[tuple[str, bool]] = []

    async def trace(event: str, info: dict[str, object]) -> None:
        await routed.trace(event, info)
        events.append((event, routed.sent))

    async with RawServer(stale_then_gone) as raw, pooled:
        timeouts = {"connect": 2.0, "read": 10.0, "write": 10.0, "pool": 2.0}
        first = httpx.Request(
            "POST", raw.url, content=b'{"x": 1}', extensions={"timeout": timeouts}
        )
        assert (await pooled.handle_async_request(first)).status_code == 200
        second = httpx.Request("POST", raw.url, content=b'{"x": 2}')
        second.extensions.update(trace=trace, timeout=timeouts)
        with pytest.raises(httpx.ConnectError):
            await pooled.handle_async_request(second)
    assert events[0] == ("http11.send_request_body.complete", True)  # written to the stale one
    assert routed.sent is False, events
    assert raw.connections == 1
