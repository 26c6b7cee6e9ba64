"""`GET /readyz` on a real gateway whose backend answers `GET /models` badly: each call is bounded
in time and in the gateway's memory, whatever the backend sends (its probe is the only reader)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from proxy.app import create_app
from tests.conftest import make_policy
from tests.servers import serve
from tests.upstream.rawserver import RawServer, read_request

# The probe's deadline is 2 s; a loaded machine gets wide room on top.
ANSWERED_WITHIN_S = 10.0
HUGE_BYTES = 256 * 1024 * 1024


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class ModelsBackend:
    """Answers `GET /models` with a 200 whose body comes a byte a second (`trickle`) or is
    HUGE_BYTES of spaces sent as fast as the gateway reads, with its length (`huge`) or without,
    ended by closing the connection (`endless`); counts what it sent."""

    def __init__(self, how: str) -> None:
        self.how = how
        self.sent_bytes = 0

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        size = 1_000_000 if self.how == "trickle" else HUGE_BYTES
        length = "connection: close" if self.how == "endless" else f"content-length: {size}"
        writer.write(f"HTTP/1.1 200 OK\r\n{length}\r\n\r\n".encode())
        chunk = b" " * (1 if self.how == "trickle" else 1024 * 1024)
        for _ in range(size // len(chunk)):
            writer.write(chunk)
            await writer.drain()
            self.sent_bytes += len(chunk)
            if self.how == "trickle":
                await asyncio.sleep(1.0)


async def ready_answer(url: str) -> tuple[httpx.Response, float]:
    began = time.monotonic()
    async with httpx.AsyncClient(timeout=ANSWERED_WITHIN_S * 3) as client:
        answer = await client.get(url + "/readyz")
    return answer, time.monotonic() - began


@pytest.mark.anyio
async def test_a_backend_trickling_its_model_list_cannot_hold_readyz() -> None:
    """A byte a second keeps every read within its idle limit; the probe's 2 s are for the whole
    answer. /readyz waited for as long as the backend kept trickling (for ever)."""
    backend = ModelsBackend("trickle")
    async with RawServer(backend) as raw:
        with serve(create_app(make_policy(raw.url))) as url:
            answer, took_s = await ready_answer(url)
    assert took_s < ANSWERED_WITHIN_S
    assert answer.status_code == 503
    assert answer.headers["retry-after"] == "5"  # DESIGN: on every 503
    assert answer.json()["backends"]["mock-a"] == "TotalTimeout"


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["huge", "endless"])
async def test_a_huge_model_list_is_not_read_into_memory(how: str) -> None:
    """/readyz read a backend's whole `/models` answer into memory on every call: four calls
    at once against a 600 MB answer took the gateway to 3.2 GB. It reads at most 1 MiB now, a
    read at a time, and a 200 is a 200."""
    backend = ModelsBackend(how)
    async with RawServer(backend) as raw:
        with serve(create_app(make_policy(raw.url))) as url:
            answer, took_s = await ready_answer(url)
    assert answer.status_code == 200, answer.text
    assert answer.json()["backends"]["mock-a"] == "ok"
    assert took_s < ANSWERED_WITHIN_S
    assert backend.sent_bytes < 32 * 1024 * 1024  # socket buffers; not the 256 MiB answer


class SlowModels:
    """Answers each `GET /models` well, after 1 s (the probe allows 2, room for a loaded
    machine's late timers); counts them."""

    def __init__(self) -> None:
        self.probes = 0

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            self.probes += 1
            await asyncio.sleep(1.0)
            body = b'{"object":"list","data":[]}'
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()


@pytest.mark.anyio
async def test_a_flood_of_readyz_calls_is_one_probe_per_backend_at_a_time() -> None:
    """Forty /readyz calls at once against a slow backend were forty `GET /models`, each holding
    a connection of the pool that requests use; they share one probe now."""
    backend = SlowModels()
    async with RawServer(backend) as raw:
        with serve(create_app(make_policy(raw.url))) as url:
            limits = httpx.Limits(max_connections=40)
            async with httpx.AsyncClient(timeout=ANSWERED_WITHIN_S * 3, limits=limits) as client:
                answers = await asyncio.gather(*(client.get(url + "/readyz") for _ in range(40)))
    assert [a.status_code for a in answers] == [200] * 40
    assert backend.probes <= 5, backend.probes  # the calls arrive within a probe or two, not 40
