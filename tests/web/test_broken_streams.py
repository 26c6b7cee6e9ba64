"""A stream a backend breaks off mid-way reaches its client as an error event under the 200
already sent: the usage views count it among the errors, as the client saw it, and /metrics
among the broken streams."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from tests.servers import serve
from tests.upstream.hostile import HostileBackend

ADMIN = {"authorization": "Bearer tw-broken-admin"}
KEY = "tw-broken"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    ledger = tmp_path_factory.mktemp("broken") / "ledger.db"
    with HostileBackend() as backend:
        text = f"""
storage: memory
ledger: sqlite:///{ledger}
admin_keys: [{hash_key("tw-broken-admin")}]
upstream: {{read_timeout: 5s, probe_interval: 0}}
backends:
  - {{name: hostile, url: "{backend.url}/v1", models: [hostile-llm]}}
models: {{hostile-llm: {{}}}}
tenants:
  app: {{api_keys: [{hash_key(KEY)}], models: [hostile-llm]}}
"""
        with serve(create_app(parse_policy(text, file="broken.yaml", environ={}))) as url:
            yield url


def _usage(url: str) -> dict[str, object]:
    """The tenant's row once the ledger has the request."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = httpx.get(url + "/api/usage", headers=ADMIN).json()["data"]
        if rows:
            row: dict[str, object] = rows[0]
            return row
        time.sleep(0.1)
    raise AssertionError("the ledger did not show the request within 10 s")


def test_a_stream_broken_off_counts_as_an_error(gateway: str, tmp_path: Path) -> None:
    with openai.OpenAI(base_url=gateway + "/v1", api_key=KEY, max_retries=0) as sdk:
        chunks = sdk.chat.completions.create(
            model="hostile-llm",
            messages=[{"role": "user", "content": "hello"}],
            stream=True,
            extra_body={"hostile": "cut_stream"},
        )
        seen = []
        with pytest.raises(openai.APIError):
            seen.extend(c.choices[0].delta.content for c in chunks if c.choices)
    assert seen == ["fine"] * 3
    row = _usage(gateway)
    assert (row["requests"], row["errors"], row["output_tokens"]) == (1, 1, 3)
    page = httpx.get(gateway + "/dashboard/tenants/app", headers=ADMIN).text
    errors = page.split('id="errors"')[1].split("</table>")[0]
    assert "upstream_error" in errors
    # /metrics counts it 2xx (the client got a 200), and once among the broken streams
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(httpx.get(gateway + "/metrics").text)
        for sample in family.samples
        if sample.name.startswith("tokenweir_broken_streams")
    }
    labels = (("backend", "hostile"), ("gen_ai_request_model", "hostile-llm"), ("tenant", "app"))
    assert samples == {("tokenweir_broken_streams_total", labels): 1.0}


def _errors_after(url: str, requests: int) -> object:
    """The tenant's error count once the ledger has `requests` requests (within 10 s)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = httpx.get(url + "/api/usage", headers=ADMIN).json()["data"]
        if rows and rows[0]["requests"] >= requests:
            return rows[0]["errors"]
        time.sleep(0.1)
    raise AssertionError(f"the ledger did not show {requests} requests within 10 s")


def _so_far(url: str) -> tuple[int, int]:
    rows = httpx.get(url + "/api/usage", headers=ADMIN).json()["data"]
    return (rows[0]["requests"], rows[0]["errors"]) if rows else (0, 0)


def test_a_messages_stream_the_backend_ends_with_an_error_event_counts_as_an_error(
    gateway: str,
) -> None:
    """The client gets the backend's error event (the SDK raises it); the ledger counted the
    request a success."""
    requests, errors = _so_far(gateway)
    with (
        anthropic.Anthropic(base_url=gateway, api_key=KEY, max_retries=0) as sdk,
        pytest.raises(anthropic.APIStatusError, match="Overloaded"),
        sdk.messages.stream(
            model="hostile-llm",
            max_tokens=20,
            messages=[{"role": "user", "content": "hello"}],
            extra_body={"hostile": "messages_error_event"},
        ) as stream,
    ):
        list(stream.text_stream)
    assert _errors_after(gateway, requests + 1) == errors + 1


def test_a_messages_stream_ended_before_its_message_stop_is_an_error_the_sdk_raises(
    gateway: str,
) -> None:
    """A backend that closed its stream cleanly mid-way (half an event, no message_stop): the
    client got the truncated stream as if whole (the SDK's final message had no stop_reason),
    and the ledger counted a success."""
    requests, errors = _so_far(gateway)
    texts: list[str] = []
    with (
        anthropic.Anthropic(base_url=gateway, api_key=KEY, max_retries=0) as sdk,
        pytest.raises(anthropic.APIStatusError, match="before its last event"),
        sdk.messages.stream(
            model="hostile-llm",
            max_tokens=20,
            messages=[{"role": "user", "content": "hello"}],
            extra_body={"hostile": "messages_ended_early"},
        ) as stream,
    ):
        texts.extend(stream.text_stream)
    assert texts == ["fine"]
    assert _errors_after(gateway, requests + 1) == errors + 1


def test_a_responses_stream_ended_before_its_last_event_is_an_error_the_sdk_raises(
    gateway: str,
) -> None:
    """The same on Responses: no response.completed (nor incomplete, failed, error), the last
    event half sent. The openai SDK's iteration ended silently on the deltas so far."""
    requests, errors = _so_far(gateway)
    seen: list[str] = []
    with openai.OpenAI(base_url=gateway + "/v1", api_key=KEY, max_retries=0) as sdk:
        events = sdk.responses.create(
            model="hostile-llm",
            input="hello",
            stream=True,
            extra_body={"hostile": "responses_ended_early"},
        )
        with pytest.raises(openai.APIError, match="before its last event"):
            seen.extend(event.type for event in events)
    assert seen == ["response.created", "response.output_text.delta"]  # not half the third
    assert _errors_after(gateway, requests + 1) == errors + 1


def test_a_failed_response_counts_as_an_error(gateway: str) -> None:
    requests, errors = _so_far(gateway)
    with openai.OpenAI(base_url=gateway + "/v1", api_key=KEY, max_retries=0) as sdk:
        events = sdk.responses.create(
            model="hostile-llm",
            input="hello",
            stream=True,
            extra_body={"hostile": "responses_failed"},
        )
        assert [event.type for event in events][-1] == "response.failed"
    assert _errors_after(gateway, requests + 1) == errors + 1


def test_a_whole_response_that_failed_counts_as_an_error(gateway: str) -> None:
    """A whole Responses answer at 200 whose status is `failed` (the backend's model failed)
    was a success in the ledger and the metrics, where its stream's `response.failed` is not."""
    requests, errors = _so_far(gateway)
    with openai.OpenAI(base_url=gateway + "/v1", api_key=KEY, max_retries=0) as sdk:
        answer = sdk.responses.create(
            model="hostile-llm", input="hello", extra_body={"hostile": "responses_failed_whole"}
        )
    assert answer.status == "failed"
    assert _errors_after(gateway, requests + 1) == errors + 1


def _totals(url: str) -> tuple[int, int, int]:
    rows = httpx.get(url + "/api/usage", headers=ADMIN).json()["data"]
    row = rows[0] if rows else {"requests": 0, "input_tokens": 0, "output_tokens": 0}
    return row["requests"], row["input_tokens"], row["output_tokens"]


def test_a_messages_stream_broken_off_after_its_usage_shows_the_usage_billed(
    gateway: str,
) -> None:
    """The message_delta whose usage was no count was held to be shown as billed; the stream
    broke off before its end, and the client got the error event without it."""
    requests, input_before, output_before = _totals(gateway)
    body = {"model": "hostile-llm", "max_tokens": 20, "stream": True,
            "messages": [{"role": "user", "content": "hello"}],
            "hostile": "messages_cut_after_usage"}  # fmt: skip
    answer = httpx.post(gateway + "/v1/messages", json=body, headers={"x-api-key": KEY})
    events = [e for e in answer.text.split("\n\n") if e.startswith("event: ")]
    assert [e.split("\n")[0] for e in events[-2:]] == ["event: message_delta", "event: error"]
    shown = orjson.loads(events[-2].split("data: ", 1)[1])["usage"]
    assert _errors_after(gateway, requests + 1) is not None
    _, input_after, output_after = _totals(gateway)
    assert (shown["input_tokens"], shown["output_tokens"]) == (
        input_after - input_before,
        output_after - output_before,
    )
