"""A chat stream's end as its client reads it, through a real gateway, the openai SDK and a
raw-socket backend: the usage chunk shows the output billed, also where the gateway's count of
the deltas relayed overrules the backend's; a stream the backend closes before `[DONE]` ends as
a broken one if its answer is visibly incomplete, and as a whole one if it is not."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from tests.servers import serve
from tests.upstream.hostile import HostileBackend
from tests.upstream.hostile_chat import CHAT_ENDINGS
from tests.web.test_agent_usage_checks import billed
from tests.web.test_broken_streams import ADMIN, KEY, _errors_after, _so_far

HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """Its backend's circuit stays closed: the streams cut short here each count as a failure."""
    ledger = tmp_path_factory.mktemp("chatends") / "ledger.db"
    with HostileBackend(CHAT_ENDINGS) as backend:
        text = f"""
storage: memory
ledger: sqlite:///{ledger}
admin_keys: [{hash_key(ADMIN["authorization"].removeprefix("Bearer "))}]
upstream: {{read_timeout: 5s, probe_interval: 0, circuit: {{failures: 1000}}}}
backends:
  - {{name: hostile, url: "{backend.url}/v1", models: [hostile-llm]}}
models: {{hostile-llm: {{}}}}
tenants:
  app: {{api_keys: [{hash_key(KEY)}], models: [hostile-llm]}}
"""
        with serve(create_app(parse_policy(text, file="chatends.yaml", environ={}))) as url:
            yield url, ledger


def _stream(
    url: str, hostile: str, *, usage: bool, into: list[str | None] | None = None
) -> tuple[list[ChatCompletionChunk], str]:
    """The chunks the SDK read of a chat stream, and the request's id; `into` gets each
    chunk's text as it comes."""
    with openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=10) as sdk:
        options = {"stream_options": {"include_usage": True}} if usage else {}
        raw = sdk.chat.completions.with_raw_response.create(
            model="hostile-llm",
            messages=HELLO,  # type: ignore[arg-type]
            stream=True,
            extra_body={"hostile": hostile},
            **options,  # type: ignore[arg-type]
        )
        chunks = []
        for chunk in raw.parse():
            chunks.append(chunk)
            if into is not None and chunk.choices:
                into.append(chunk.choices[0].delta.content)
        return chunks, raw.headers["x-request-id"]


@pytest.mark.parametrize("hostile", ["chat_under_reported", "chat_under_reported_in_choice"])
def test_a_chat_stream_that_under_reports_its_output_shows_the_output_billed(
    gateway: tuple[str, Path], hostile: str
) -> None:
    """The backend says 1 output token after 11 content deltas: the ledger bills the gateway's
    count of them (`counted_output`: a lower bound, 11 less a role and a finish event), and
    the SDK's last chunk said 1."""
    url, ledger = gateway
    chunks, request_id = _stream(url, hostile, usage=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "fine" * 11
    usage = chunks[-1].usage
    assert usage is not None
    input_tokens, output_tokens, source = billed(ledger, request_id)
    assert source == "counted_output"
    assert output_tokens > 1
    assert (usage.prompt_tokens, usage.completion_tokens) == (input_tokens, output_tokens)
    assert usage.total_tokens == input_tokens + output_tokens


def test_a_usage_the_client_did_not_ask_for_stays_out_of_its_stream(
    gateway: tuple[str, Path],
) -> None:
    """The gateway asked for it to bill the stream; overruled or not, the client never sees it."""
    url, ledger = gateway
    chunks, request_id = _stream(url, "chat_under_reported", usage=False)
    assert all(c.usage is None and c.choices for c in chunks)
    assert billed(ledger, request_id)[2] == "counted_output"
    body = {"model": "hostile-llm", "messages": HELLO, "stream": True}
    answer = httpx.post(
        url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {KEY}"},
        json={**body, "hostile": "chat_under_reported"},
    )
    assert b'"usage"' not in answer.content
    assert answer.content.endswith(b"data: [DONE]\n\n")


def _raw(url: str, hostile: str, *, usage: bool) -> bytes:
    options = {"stream_options": {"include_usage": True}} if usage else {}
    body = {"model": "hostile-llm", "messages": HELLO, "stream": True, **options}
    answer = httpx.post(
        url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {KEY}"},
        json={**body, "hostile": hostile},
        timeout=10,
    )
    return answer.content


@pytest.mark.parametrize(
    ("hostile", "usage", "texts"),
    [
        ("chat_ended_between_events", False, 3),
        ("chat_ended_mid_event", False, 3),
        ("chat_ended_mid_event", True, 3),
        # The whole answer, but not the usage chunk the client asked for.
        ("chat_ended_before_usage", True, 11),
    ],
)
def test_a_chat_stream_closed_before_its_end_is_an_error_the_sdk_raises(
    gateway: tuple[str, Path], hostile: str, usage: bool, texts: int
) -> None:
    """The backend closed the stream cleanly, without [DONE], its answer visibly incomplete:
    the SDK took what came as the whole answer, and the ledger counted a success."""
    url, _ = gateway
    requests, errors = _so_far(url)
    seen: list[str | None] = []
    with pytest.raises(openai.APIError, match="before its last event"):
        _stream(url, hostile, usage=usage, into=seen)
    assert seen == ["fine"] * texts
    assert _errors_after(url, requests + 1) == errors + 1


@pytest.mark.parametrize(
    ("hostile", "usage"),
    [("chat_ended_before_usage", False), ("chat_ended_without_done", True)],
)
def test_a_chat_stream_whole_but_for_its_done_ends_as_a_whole_one(
    gateway: tuple[str, Path], hostile: str, usage: bool
) -> None:
    """Every choice had its finish_reason (and the usage asked for came): some servers omit
    [DONE], and the client gets the one it expects."""
    url, ledger = gateway
    requests, errors = _so_far(url)
    chunks, request_id = _stream(url, hostile, usage=usage)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "fine" * 11
    assert chunks[-1 - usage].choices[0].finish_reason == "stop"
    if usage:
        shown = chunks[-1].usage
        assert shown is not None
        assert (shown.prompt_tokens, shown.completion_tokens) == billed(ledger, request_id)[:2]
    assert _errors_after(url, requests + 1) == errors
    assert _raw(url, hostile, usage=usage).endswith(b"data: [DONE]\n\n")
