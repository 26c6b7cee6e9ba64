"""A real `tokenweir serve` in front of a hostile backend (tests/upstream/hostile.py): whatever the
backend sends, the client gets a well-formed answer or an OpenAI-shaped error in bounded time, the
gateway's memory stays bounded, and the next request is served normally."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from proxy.policy.units import hash_key
from tests.servers import replicas
from tests.upstream.hostile import DEEP, HostileBackend, hostile_backend

KEY = "tw-hostile"
MODEL = "hostile-llm"  # its backend has a first_byte_timeout of 2 s
IDLE_MODEL = "hostile-idle"  # its backend has none: read_timeout (1 s) bounds the first byte
MESSAGES: list[Any] = [{"role": "user", "content": "hello"}]
# Far above the gateway's own few dozen MB plus one capped body (32 MiB, the default), far below
# what buffering a hostile body costs (the 800 MB one alone).
RSS_BOUND_BYTES = 300 * 1024 * 1024
# Past this the backend is cut off, so that a gateway that buffers everything fails the test
# without taking the machine down.
RSS_GUARD_BYTES = 400 * 1024 * 1024
# Each misbehaviour below would go on for minutes (or forever); the gateway's deadlines are
# seconds: an answer within this shows a deadline cut it, on a loaded machine too.
ANSWERED_WITHIN_S = 20.0


@dataclass
class Gateway:
    process: subprocess.Popen[bytes]
    client: openai.OpenAI
    backend: HostileBackend

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS line")


@pytest.fixture(scope="module", params=["http", "https"])
def gateway(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Gateway]:
    """The gateway and its backend, over http (the gateway's own transport) or https (httpx's,
    which must hold the backend to the same limits)."""
    directory = tmp_path_factory.mktemp("hostile")
    config = directory / "policy.yaml"
    with hostile_backend(request.param, directory) as backend:
        config.write_text(f"""
storage: memory
upstream:
  read_timeout: 1s
  total_timeout: 3s
  probe_interval: 0
  circuit: {{failures: 100000}}
backends:
  - {{name: hostile, url: "{backend.url}/v1", models: [{MODEL}], first_byte_timeout: 2s}}
  - {{name: hostile-idle, url: "{backend.url}/v1", models: [{IDLE_MODEL}]}}
models: {{{MODEL}: {{}}, {IDLE_MODEL}: {{}}}}
tenants:
  app:
    api_keys: [{hash_key(KEY)}]
    models: [{MODEL}, {IDLE_MODEL}]
""")
        with (
            replicas(config, 1) as [(process, url)],
            openai.OpenAI(
                base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=ANSWERED_WITHIN_S + 10
            ) as client,
        ):
            yield Gateway(process, client, backend)


class PeakRss:
    """Samples the gateway's RSS every 20 ms while the block runs; cuts the backend off past the
    guard."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway
        self._done = threading.Event()
        self.peak_bytes = 0
        self._thread = threading.Thread(target=self._sample)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._gateway.rss_bytes())  # a quick answer, too

    def _sample(self) -> None:
        while not self._done.wait(0.02):
            self.peak_bytes = max(self.peak_bytes, self._gateway.rss_bytes())
            if self.peak_bytes > RSS_GUARD_BYTES:
                self._gateway.backend.cut()


def chat(gateway: Gateway, hostile: str, model: str = MODEL, **fields: Any) -> Any:
    return gateway.client.chat.completions.create(
        model=model, messages=MESSAGES, extra_body={"hostile": hostile}, **fields
    )


def refused(gateway: Gateway, hostile: str, **fields: Any) -> openai.APIStatusError:
    began = time.monotonic()
    with pytest.raises(openai.APIStatusError) as caught:
        chat(gateway, hostile, **fields)
    assert time.monotonic() - began < ANSWERED_WITHIN_S
    return caught.value


def assert_openai_error(error: openai.APIStatusError, status: int, code: str) -> dict[str, Any]:
    assert error.status_code == status, error
    body = error.body
    assert isinstance(body, dict), body
    assert set(body) == {"message", "type", "param", "code"}, body
    assert isinstance(body["message"], str)
    assert body["message"]
    assert isinstance(body["type"], str)
    assert body["code"] == code, body
    return body


def assert_still_serving(gateway: Gateway) -> None:
    answer = chat(gateway, "normal")
    assert answer.choices[0].message.content == "fine"
    chunks = list(chat(gateway, "normal", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "fine"


def stream_error(gateway: Gateway, hostile: str) -> openai.APIError:
    """The error event that ends a stream which began well."""
    began = time.monotonic()
    chunks = chat(gateway, hostile, stream=True)
    seen: list[str] = []
    with pytest.raises(openai.APIError) as caught:
        seen.extend(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert time.monotonic() - began < ANSWERED_WITHIN_S
    assert "fine" in seen  # the stream was under way: this is the mid-stream error, not a status
    assert not isinstance(caught.value, openai.APIStatusError)
    return caught.value


@pytest.mark.parametrize("hostile", ["endless_body", "huge_body"])
def test_a_body_past_the_cap_is_a_502_in_bounded_memory(gateway: Gateway, hostile: str) -> None:
    with PeakRss(gateway) as rss:
        error = refused(gateway, hostile)
    assert_openai_error(error, 502, "upstream_response_too_large")
    assert rss.peak_bytes < RSS_BOUND_BYTES, f"peak RSS {rss.peak_bytes / 2**20:.0f} MiB"
    assert gateway.backend.saw_hang_up(hostile)
    assert gateway.backend.sent_bytes[hostile] < 200_000_000  # cut off, not read to the end
    assert_still_serving(gateway)


def test_endless_header_bytes_are_a_502_in_bounded_memory(gateway: Gateway) -> None:
    with PeakRss(gateway) as rss:
        error = refused(gateway, "endless_headers")
    assert_openai_error(error, 502, "upstream_bad_response")
    assert rss.peak_bytes < RSS_BOUND_BYTES, f"peak RSS {rss.peak_bytes / 2**20:.0f} MiB"
    assert gateway.backend.saw_hang_up("endless_headers")
    assert_still_serving(gateway)


def test_ten_thousand_headers_are_a_502(gateway: Gateway) -> None:
    assert_openai_error(refused(gateway, "many_headers"), 502, "upstream_bad_response")
    assert gateway.backend.saw_hang_up("many_headers")
    assert_still_serving(gateway)


@pytest.mark.parametrize(
    ("hostile", "model", "deadline_s"),
    [
        ("header_trickle", MODEL, 2.0),
        ("header_flood", MODEL, 2.0),
        ("header_trickle", IDLE_MODEL, 1.0),
        ("header_flood", IDLE_MODEL, 1.0),
    ],
)
def test_a_trickled_head_cannot_defeat_the_first_byte_deadline(
    gateway: Gateway, hostile: str, model: str, deadline_s: float
) -> None:
    """A header byte every half second (or millisecond), under the head's size cap: each read comes
    within read_timeout, the head never ends. It must all come within first_byte_timeout, or
    read_timeout where that is unset."""
    began = time.monotonic()
    assert_openai_error(refused(gateway, hostile, model=model), 504, "upstream_timeout")
    assert time.monotonic() - began >= deadline_s * 0.95  # that deadline, not something else
    assert gateway.backend.saw_hang_up(hostile)
    assert_still_serving(gateway)


@pytest.mark.parametrize("hostile", ["sse_comments", "sse_blank_lines"])
def test_a_stream_without_content_ends_with_upstream_timeout(
    gateway: Gateway, hostile: str
) -> None:
    """Comments or blank lines every 0.1 s keep the socket busy but carry no content."""
    error = stream_error(gateway, hostile)
    assert isinstance(error.body, dict)
    assert error.body["code"] == "upstream_timeout"
    assert gateway.backend.saw_hang_up(hostile)
    assert_still_serving(gateway)


def test_a_stream_that_never_ends_is_cut_at_the_total_timeout(gateway: Gateway) -> None:
    began = time.monotonic()
    error = stream_error(gateway, "slow_tokens")
    assert time.monotonic() - began >= 2.9  # total_timeout: 3 s
    assert isinstance(error.body, dict)
    assert error.body["code"] == "upstream_timeout"
    assert gateway.backend.saw_hang_up("slow_tokens")
    assert_still_serving(gateway)


def test_a_whole_answer_that_never_ends_is_a_504_at_the_total_timeout(gateway: Gateway) -> None:
    began = time.monotonic()
    assert_openai_error(refused(gateway, "slow_whole"), 504, "upstream_timeout")
    assert time.monotonic() - began >= 2.9
    assert gateway.backend.saw_hang_up("slow_whole")
    assert_still_serving(gateway)


def test_bad_chunked_framing_is_a_502(gateway: Gateway) -> None:
    assert_openai_error(refused(gateway, "bad_chunks"), 502, "upstream_error")
    assert_still_serving(gateway)


@pytest.mark.parametrize("hostile", ["html_200", "list_200", "hello_200", "choices_not_list"])
def test_a_200_that_is_no_completion_is_a_502(gateway: Gateway, hostile: str) -> None:
    assert_openai_error(refused(gateway, hostile), 502, "upstream_bad_response")
    assert_still_serving(gateway)


@pytest.mark.parametrize("hostile", ["hello_200", "html_200"])
def test_a_200_that_is_no_embedding_list_is_a_502(gateway: Gateway, hostile: str) -> None:
    client = gateway.client
    fine = client.embeddings.create(model=MODEL, input="x", extra_body={"hostile": "normal"})
    assert fine.data[0].embedding == [0.5, 0.25]
    with pytest.raises(openai.APIStatusError) as caught:
        client.embeddings.create(model=MODEL, input="x", extra_body={"hostile": hostile})
    assert_openai_error(caught.value, 502, "upstream_bad_response")


@pytest.mark.parametrize("hostile", ["json_for_stream", "html_200", "sse_html_event", "sse_empty"])
def test_a_stream_that_is_no_event_stream_is_a_502(gateway: Gateway, hostile: str) -> None:
    assert_openai_error(refused(gateway, hostile, stream=True), 502, "upstream_bad_response")
    assert_still_serving(gateway)


@pytest.mark.parametrize(
    ("hostile", "status", "retry_after"),
    [
        ("retry_after_nan", 429, "1"),
        ("retry_after_inf", 503, "1"),
        ("retry_after_huge", 429, "3600"),
        ("retry_after_negative", 503, "1"),
        ("retry_after_text", 429, "1"),
        ("retry_after_date", 429, "3600"),
        ("retry_after_seconds", 503, "7"),
    ],
)
def test_a_backend_retry_after_is_parsed_and_clamped(
    gateway: Gateway, hostile: str, status: int, retry_after: str
) -> None:
    error = refused(gateway, hostile)
    assert error.status_code == status
    assert error.response.headers["retry-after"] == retry_after
    assert isinstance(error.body, dict)
    assert isinstance(error.body["message"], str)
    assert_still_serving(gateway)


def test_backend_error_fields_come_back_as_strings(gateway: Gateway) -> None:
    error = refused(gateway, "code_object")
    assert error.status_code == 400
    assert error.body == {
        "message": '{"text":"nested"}',
        "type": '["invalid","request"]',
        "param": "7",
        "code": '{"reason":"bad","detail":[1,2]}',
    }
    assert_still_serving(gateway)


def test_a_backend_error_nested_past_what_orjson_writes_comes_back_as_a_string(
    gateway: Gateway,
) -> None:
    """A message 300 levels deep was a 500 (writing it as JSON text raised); it is the
    backend's 400 with the message as JSON text, on chat and in Anthropic's shape on
    /v1/messages."""
    error = refused(gateway, "deep_error")
    assert error.status_code == 400
    assert isinstance(error.body, dict)
    assert error.body["message"] == DEEP.decode()
    with (
        anthropic.Anthropic(
            base_url=str(gateway.client.base_url).removesuffix("/v1/"), api_key=KEY, max_retries=0
        ) as client,
        pytest.raises(anthropic.BadRequestError) as caught,
    ):
        client.messages.create(
            model=MODEL, max_tokens=5, messages=MESSAGES, extra_body={"hostile": "deep_error"}
        )
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": DEEP.decode()},
    }
    assert_still_serving(gateway)


def test_a_messages_stream_that_goes_on_after_its_end_is_relayed_as_it_comes(
    gateway: Gateway,
) -> None:
    """Events after message_stop reach the client while the stream is open, message_stop first
    (they were held to the end, each read searched again: a core for one request)."""
    gateway.backend.client_has_after.clear()
    body = {"model": MODEL, "max_tokens": 50, "messages": MESSAGES, "stream": True,
            "hostile": "messages_after_end"}  # fmt: skip
    received = b""
    with httpx.stream(
        "POST", f"{gateway.client.base_url}messages", json=body,
        headers={"authorization": f"Bearer {KEY}"}, timeout=ANSWERED_WITHIN_S,
    ) as response:  # fmt: skip
        assert response.status_code == 200
        for chunk in response.iter_raw():
            received += chunk
            if b'"after"' in received:
                gateway.backend.client_has_after.set()
    assert gateway.backend.after_seen_in_time  # before the backend ended the stream
    assert received.index(b"event: message_stop") < received.index(b'"after"')
    assert b"upstream_timeout" not in received
    assert_still_serving(gateway)
