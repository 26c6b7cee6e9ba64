"""A stream's middle chunks written by the backend connection's callback straight to the client's
(proxy/asgi/direct.py), under the same uvicorn protocol `tokenweir serve` runs: the client gets
every byte, in order, fast or slow."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from proxy.app import create_app
from proxy.asgi.direct import (
    DirectBody,
    body_arrived,
    direct_body,
    has_cycle_fields,
    lend_cycle,
    lent_cycle,
)
from proxy.tools.mock import backend as mockbackend
from tests.conftest import ALPHA_KEY, BACKEND_KEY, make_policy
from tests.servers import serve

MESSAGES: list[Any] = [{"role": "user", "content": "Tell me about weirs."}]


class Spy:
    """Counts the direct writer's writes, and the most its client's transport held unsent
    after one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.writes = 0
        self.most_held = 0
        write = DirectBody.write

        def counting_write(body: DirectBody, data: bytes) -> None:
            write(body, data)
            self.writes += 1
            held = body._cycle.transport.get_write_buffer_size()
            self.most_held = max(self.most_held, held)

        monkeypatch.setattr(DirectBody, "write", counting_write)


def asking(tokens: int) -> dict[str, Any]:
    """A streamed chat request for exactly `tokens` tokens of the simulated backend's text."""
    return {
        "model": "mock-llm",
        "messages": MESSAGES,
        "max_tokens": tokens,
        "mock_completion_tokens": tokens,
        "stream": True,
    }


def backend_text(backend_url: str, tokens: int) -> str:
    """What the simulated backend answers, asked directly (its answer depends on the prompt)."""
    body = {**asking(tokens), "stream": False}
    answer = httpx.post(
        backend_url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {BACKEND_KEY}"},
        timeout=30,
    )
    answer.raise_for_status()
    text: str = answer.json()["choices"][0]["message"]["content"]
    return text


def test_a_streams_middle_chunks_go_straight_to_the_client_whole_and_in_order(
    client: openai.OpenAI, backend_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = Spy(monkeypatch)
    chunks = list(
        client.chat.completions.create(
            model="mock-llm",
            messages=MESSAGES,
            max_tokens=64,
            stream=True,
            extra_body={"mock_completion_tokens": 64},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == backend_text(backend_url, 64)
    assert spy.writes >= 1, "no chunk went the direct way"


@pytest.fixture(scope="module")
def fast_gateway() -> Iterator[tuple[str, str]]:
    """A gateway on a backend of 20,000 tokens/s: (gateway URL, backend URL)."""
    with serve(mockbackend.create_app(tokens_per_second=20_000)) as backend_url:
        with serve(create_app(make_policy(backend_url))) as gateway_url:
            yield gateway_url, backend_url


def read_stream_slowly(gateway_url: str, body: bytes) -> bytes:
    """POST `body` with a small receive window, read nothing for 3 s, then everything."""
    port = int(gateway_url.rsplit(":", 1)[1])
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(60)
        sock.connect(("127.0.0.1", port))
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\n"
            b"authorization: Bearer %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % (ALPHA_KEY.encode(), len(body))
        )
        sock.sendall(head + body)
        received = bytearray(sock.recv(1))  # the answer began
        time.sleep(3.0)
        while data := sock.recv(65536):
            received += data
    return bytes(received)


def dechunk(raw: bytes) -> bytes:
    """The body of a chunked HTTP/1.1 response."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower(), head
    body = bytearray()
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return bytes(body)
        body += rest[:size]
        assert rest[size : size + 2] == b"\r\n"
        rest = rest[size + 2 :]


def test_a_client_that_reads_slowly_still_gets_every_byte_in_order(
    fast_gateway: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """About 7 MB of events while the client reads nothing for 3 s: the sockets' buffers fill,
    uvicorn pauses writing, and the reads wait for the task's `send` until the client drains.
    The gateway holds no more than its write buffer's high-water mark (64 KB) and a chunk: a
    direct writer that wrote on regardless would hold megabytes."""
    gateway_url, backend_url = fast_gateway
    spy = Spy(monkeypatch)
    tokens = 40_000
    raw = read_stream_slowly(gateway_url, orjson.dumps(asking(tokens)))
    events = [e for e in dechunk(raw).split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    chunks = [orjson.loads(e[6:]) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == backend_text(backend_url, tokens)
    assert spy.writes >= 1, "no chunk went the direct way"
    assert spy.most_held < 1024 * 1024, f"{spy.most_held} bytes held for a slow client"


def test_clients_that_reset_mid_stream_are_recorded_as_gone_and_log_no_error(
    fast_gateway: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Clients that reset their connection while their streams' chunks go the direct way: each
    request is recorded as the client gone, and nothing is logged as an error (a direct write to
    a closed transport raises on uvloop, which would end the request as an unexpected error)."""
    caplog.set_level(logging.INFO)
    gateway_url, _ = fast_gateway
    port = int(gateway_url.rsplit(":", 1)[1])
    body = orjson.dumps(asking(40_000))
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\n"
        b"authorization: Bearer %s\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % (ALPHA_KEY.encode(), len(body))
    )
    resets = 20
    for _ in range(resets):
        with socket.socket() as sock:
            sock.settimeout(30)
            sock.connect(("127.0.0.1", port))
            sock.sendall(head + body)
            received = 0
            while received < 20_000:
                data = sock.recv(65536)
                assert data, f"the gateway closed the connection after {received} bytes"
                received += len(data)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    deadline = time.monotonic() + 30
    while len(access_records(caplog)) < resets and time.monotonic() < deadline:
        time.sleep(0.05)
    records = access_records(caplog)
    assert len(records) == resets
    assert all(r["client_disconnected"] and not r["completed"] for r in records), records
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []


def access_records(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "tokenweir.access"]


def uvicorn_cycle() -> RequestResponseCycle:
    """A response cycle as this uvicorn makes one for a request."""
    transport = asyncio.Transport()
    return RequestResponseCycle(
        scope={"type": "http", "method": "POST"},  # type: ignore[typeddict-item]
        transport=transport,
        flow=FlowControl(transport),
        logger=logging.getLogger("test"),
        access_logger=logging.getLogger("test"),
        access_log=False,
        default_headers=[],
        message_event=asyncio.Event(),
        expect_100_continue=False,
        keep_alive=True,
        on_response=lambda: None,
    )


def test_this_uvicorns_cycles_have_what_the_direct_writer_reads() -> None:
    """It reads uvicorn's own fields, not an API: an upgrade that renames one fails here."""
    assert has_cycle_fields(uvicorn_cycle())


def test_a_body_has_arrived_only_once_uvicorn_holds_it_whole() -> None:
    """What lets the pipeline read a body with no timer: uvicorn's `receive` then hands it over
    without waiting. Each step is what the protocol's callbacks do to the cycle."""
    cycle = uvicorn_cycle()
    lend_cycle(cycle.scope, cycle)
    lent = lent_cycle(cycle.scope)
    assert not body_arrived(lent)  # the headers only
    cycle.body += b'{"model": '  # on_body
    cycle.message_event.set()
    assert not body_arrived(lent)  # part of it
    cycle.body += b'"m"}'
    cycle.more_body = False  # on_message_complete
    assert body_arrived(lent)
    message = asyncio.run(asyncio.wait_for(cycle.receive(), timeout=5))
    assert message == {"type": "http.request", "body": b'{"model": "m"}', "more_body": False}
    assert not body_arrived(None)  # nothing lent: any other server


def test_a_cycle_without_them_lends_nothing_and_its_streams_go_through_send() -> None:
    class Renamed(RequestResponseCycle):
        pass

    cycle = Renamed.__new__(Renamed)
    cycle.__dict__.update(vars(uvicorn_cycle()))
    del cycle.flow
    assert not has_cycle_fields(cycle)
    lend_cycle(cycle.scope, cycle)
    assert direct_body(lent_cycle(cycle.scope)) is None
    whole = uvicorn_cycle()
    lend_cycle(whole.scope, whole)
    assert direct_body(lent_cycle(whole.scope)) is not None
