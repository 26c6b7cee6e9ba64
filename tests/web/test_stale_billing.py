"""A client that leaves while its request, dropped by the backend on a stale keep-alive
connection, waits for a new connection: no backend took it, so it bills nothing."""

from __future__ import annotations

import logging
import socket
import threading
import time
from contextlib import suppress
from typing import Any

import httpx
import orjson
import pytest

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from tests.conftest import ALPHA_KEY
from tests.servers import serve

ANSWER = orjson.dumps({
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "mock-llm",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10},
})  # fmt: skip
MODELS = orjson.dumps({"object": "list", "data": [{"id": "mock-llm", "object": "model"}]})


class _StaleThenFull:
    """Answers GETs and the first chat request on kept-alive connections; the second chat
    request it reads, then fills its listen queue (a new connection's SYN goes unanswered, so
    the connect hangs) and closes the connection without a byte: a stale keep-alive one."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=1)
        self.listener.settimeout(0.05)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.full = threading.Event()
        self.stop = threading.Event()
        self.chats = 0
        self._fillers: list[socket.socket] = []
        self._threads: list[threading.Thread] = []

    def run(self) -> None:
        while not self.stop.is_set():
            if self.full.is_set():
                time.sleep(0.05)
                continue
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        with conn, reader, suppress(OSError):
            while not self.stop.is_set():
                head = b""
                while not head.endswith(b"\r\n\r\n"):
                    line = reader.readline()
                    if not line:
                        return
                    head += line
                length = [int(h.split(b":")[1]) for h in head.lower().split(b"\r\n")
                          if h.startswith(b"content-length:")]  # fmt: skip
                reader.read(length[0] if length else 0)
                body = MODELS
                if head.startswith(b"POST"):
                    self.chats += 1
                    if self.chats == 2:
                        self._fill_queue()
                        return  # closed without an answer
                    body = ANSWER
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(body), body)
                )

    def _fill_queue(self) -> None:
        self.full.set()
        port = self.listener.getsockname()[1]
        for _ in range(8):  # until a connect is left waiting: the queue is full
            filler = socket.socket()
            filler.setblocking(False)
            self._fillers.append(filler)
            with suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
            time.sleep(0.05)
            try:
                filler.getpeername()
            except OSError:
                return

    def __enter__(self) -> _StaleThenFull:
        self._threads.append(threading.Thread(target=self.run, daemon=True))
        self._threads[-1].start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(5)
        for filler in self._fillers:
            filler.close()
        self.listener.close()


def test_a_client_that_leaves_while_a_stale_connections_request_is_resent_bills_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The request went out whole on a kept-alive connection the backend then closed without
    a byte; the gateway sends it again on a new connection, whose connect hangs, and the
    client leaves. It was billed its prompt (9 tokens counted: the first write's `sent` mark
    stood); no backend took it, so nothing is billed."""
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    with _StaleThenFull() as backend:
        policy = parse_policy(
            f"""
upstream: {{connect_timeout: 20s, read_timeout: 20s, probe_interval: 0}}
backends: [{{name: b, url: "{backend.url}/v1", models: [mock-llm]}}]
models: {{mock-llm: {{price: {{input_per_1m: 1.0, output_per_1m: 2.0}}}}}}
tenants:
  alpha: {{api_keys: [{hash_key(ALPHA_KEY)}], models: [mock-llm]}}
""",
            file="stale.yaml",
            environ={},
        )
        chat: dict[str, Any] = {
            "model": "mock-llm",
            "messages": [{"role": "user", "content": "hi"}],
        }
        auth = {"authorization": f"Bearer {ALPHA_KEY}"}
        with serve(create_app(policy)) as gateway, httpx.Client(headers=auth) as http:
            first = http.post(gateway + "/v1/chat/completions", json=chat, timeout=10)
            assert first.status_code == 200, first.text  # its connection is kept alive
            with pytest.raises(httpx.ReadTimeout):
                http.post(gateway + "/v1/chat/completions", json=chat, timeout=1.5)
            assert backend.full.is_set()  # the backend dropped it, the resend waits
            deadline = time.monotonic() + 10
            while len(_lines(caplog)) < 2:
                assert time.monotonic() < deadline
                time.sleep(0.02)
    line = _lines(caplog)[1]
    assert line["client_disconnected"] is True, line
    assert (line["input_tokens"], line["output_tokens"], line["usage_source"]) == (0, 0, None)


def _lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "tokenweir.access"]
