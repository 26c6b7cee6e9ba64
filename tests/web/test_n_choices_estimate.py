"""n = 2 on a model without a tokenizer: the gateway's estimate of the answer checks the backend's
usage. An honest backend (the mock) is billed what it reports; a raw-socket backend that counts
only one of the two choices is still overruled."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson

from proxy.app import create_app
from proxy.tokens.estimate import estimate_tokens
from tests.servers import serve
from tests.web.test_billing import billing_policy, chat, ledger_records

__all__ = ["ledger_path"]  # fixture
from tests.web.test_billing import ledger_path

PER_CHOICE = 44
"""What the raw backend says each of its choices is, in tokens: 40 "the " read as 40 by the
estimate (4 characters a token), so the estimate reads 0.91 of the truth, as much prose does."""


def test_an_honest_mock_answer_of_two_choices_is_billed_as_the_backend_reports(
    backend_url: str, ledger_path: Path
) -> None:
    """The mock's words average 6 characters with their space: the estimate reads 1.5 times
    their tokens, 1.52 for this answer, above the old bar for n = 2 (1.5 times the report):
    the gateway billed its estimate (388) for the mock's honest 256."""
    with serve(create_app(billing_policy(backend_url, ledger_path))) as url:
        answer = chat(url, model="guess-llm", n=2, max_tokens=128)
    assert answer.status_code == 200
    reported = answer.json()["usage"]["completion_tokens"]
    estimated = sum(estimate_tokens(c["message"]["content"]) for c in answer.json()["choices"])
    assert reported == 256
    assert estimated > 1.5 * reported  # the case the old bar overruled
    [record] = ledger_records(ledger_path, 1)
    assert (record.usage_source, record.output_tokens) == ("backend", reported)


def test_a_raw_backend_reporting_one_of_two_choices_is_still_overruled(ledger_path: Path) -> None:
    with one_choice_backend() as url, serve(create_app(billing_policy(url, ledger_path))) as gw:
        answer = chat(gw, model="guess-llm", n=2, max_tokens=100)
    assert answer.status_code == 200
    assert len(answer.json()["choices"]) == 2
    [record] = ledger_records(ledger_path, 1)
    # The estimate of both choices (80), not the one choice reported (44)
    assert (record.usage_source, record.output_tokens) == ("counted_output", 80)


@contextmanager
def one_choice_backend() -> Iterator[str]:
    """Answers every request with two choices of 40 "the " each and usage counting only the
    first (44 tokens), each on a connection of its own."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()
    choice = {"message": {"role": "assistant", "content": "the " * 40}, "finish_reason": "stop"}
    body = orjson.dumps({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "guess-llm",
        "choices": [{**choice, "index": 0}, {**choice, "index": 1}],
        "usage": {"prompt_tokens": 9, "completion_tokens": PER_CHOICE,
                  "total_tokens": 9 + PER_CHOICE},
    })  # fmt: skip
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
    whole = head + b"content-length: %d\r\n\r\n" % len(body) + body

    def run() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                _read_request(conn)
                conn.sendall(whole)

    thread = threading.Thread(target=run, name="one-choice-backend", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def _read_request(conn: socket.socket) -> None:
    """One request: its head, and its Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    while len(rest) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return
        rest += chunk
