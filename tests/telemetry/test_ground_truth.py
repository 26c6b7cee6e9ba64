"""The gateway's figures judged against a backend whose every byte and pause the test wrote."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from tests.conftest import ALPHA_KEY, make_policy
from tests.servers import serve
from tests.telemetry.scripted import Script, chunk, event, named, scripted_backend, usage_chunk

SCRIPTS: dict[str, Script] = {
    "backend-rate-limited": (429, {"message": "Rate limit reached", "type": "requests",
                                   "code": "rate_limit_exceeded"}),
    "backend-out-of-credit": (429, {"message": "You exceeded your current quota",
                                    "type": "insufficient_quota", "code": "insufficient_quota"}),
    # Three tokens 0.1 s apart, then the finish event (no text) 2 s later, as a backend that checks
    # the whole answer before it ends sends it; then usage and [DONE].
    "late-finish": [
        chunk({"role": "assistant", "content": ""}), 0.05, chunk({"content": "a"}), 0.1,
        chunk({"content": "b"}), 0.1, chunk({"content": "c"}), 2.0, chunk({}, "stop"),
        usage_chunk(5, 3), b"data: [DONE]\n\n",
    ],
    # n = 2, one token each, the second choice's 0.05 s after the first's: no token was
    # generated after the first of its choice.
    "two-choices-one-token": [
        chunk({"role": "assistant", "content": ""}),
        chunk({"role": "assistant", "content": ""}, index=1),
        0.05, chunk({"content": "a"}), 0.05, chunk({"content": "b"}, index=1), 0.05,
        chunk({}, "length"), chunk({}, "length", index=1), usage_chunk(5, 2), b"data: [DONE]\n\n",
    ],
}  # fmt: skip
# Four tokens 0.2 s apart, each followed 0.1 s later by an event without text: a content
# filter's verdict, empty `choices`, a role alone; then the finish.
_VERDICT = {
    "index": 0,
    "finish_reason": None,
    "content_filter_results": {"hate": {"filtered": False}},
}
_TEXTLESS_BETWEEN: list[bytes | float] = [
    chunk({"role": "assistant", "content": ""}), 0.05, chunk({"content": "a"}), 0.1,
    event({"id": "chatcmpl-scripted", "choices": [_VERDICT]}), 0.1, chunk({"content": "b"}), 0.1,
    event({"id": "chatcmpl-scripted", "choices": []}), 0.1, chunk({"content": "c"}), 0.1,
    chunk({"role": "assistant"}), 0.1, chunk({"content": "d"}), chunk({}, "stop"),
]  # fmt: skip
SCRIPTS["textless-between"] = [*_TEXTLESS_BETWEEN, usage_chunk(5, 4), b"data: [DONE]\n\n"]
SCRIPTS["textless-between-no-usage"] = [*_TEXTLESS_BETWEEN, b"data: [DONE]\n\n"]

# A tool call's name 0.3 s after the role, its arguments 1 s later; a refusal 0.3 s after the
# role. No usage: the bill is the gateway's estimate.
_CALL = {
    "index": 0,
    "id": "call_1",
    "type": "function",
    "function": {"name": "weather", "arguments": ""},
}
SCRIPTS["tool-call"] = [
    chunk({"role": "assistant", "content": None}), 0.3, chunk({"tool_calls": [_CALL]}), 1.0,
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city"'}}]}), 0.05,
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": ':"Paris"}'}}]}),
    chunk({}, "tool_calls"), b"data: [DONE]\n\n",
]  # fmt: skip
SCRIPTS["refusal"] = [
    chunk({"role": "assistant", "content": None}), 0.3, chunk({"refusal": "I can't"}), 0.05,
    chunk({"refusal": " help with that."}), chunk({}, "stop"), b"data: [DONE]\n\n",
]  # fmt: skip


# A tool call's name 0.3 s after the stream began, its arguments 1 s later, on the agent APIs:
# Messages names it in content_block_start (its first input_json_delta empty, as Anthropic
# sends it), Responses in response.output_item.added (after response.created, whose echoed
# `tools` name it too: no call yet).
_ANTHROPIC = {"anthropic-version": "2023-06-01"}
SCRIPTS["messages-tool-call"] = [
    named({"type": "message_start", "message": {"id": "msg_1", "type": "message",
           "role": "assistant", "model": "mock-llm", "content": [],
           "usage": {"input_tokens": 5, "output_tokens": 1}}}),
    0.3, named({"type": "content_block_start", "index": 0, "content_block": {
        "type": "tool_use", "id": "toolu_1", "name": "weather", "input": {}}}),
    named({"type": "content_block_delta", "index": 0,
           "delta": {"type": "input_json_delta", "partial_json": ""}}),
    1.0, named({"type": "content_block_delta", "index": 0,
                "delta": {"type": "input_json_delta", "partial_json": '{"city":"Paris"}'}}),
    named({"type": "content_block_stop", "index": 0}),
    named({"type": "message_delta", "delta": {"stop_reason": "tool_use"},
           "usage": {"output_tokens": 5}}),
    named({"type": "message_stop"}),
]  # fmt: skip
_RESPONSE = {"id": "resp_1", "object": "response", "status": "in_progress", "model": "mock-llm",
             "output": [], "tools": [{"type": "function", "name": "weather"}]}  # fmt: skip
_ARGUMENTS = {"type": "response.function_call_arguments.delta", "item_id": "fc_1",
              "output_index": 0, "delta": '{"city":"Paris"}', "sequence_number": 2}  # fmt: skip
SCRIPTS["responses-tool-call"] = [
    named({"type": "response.created", "response": _RESPONSE, "sequence_number": 0}),
    0.3, named({"type": "response.output_item.added", "output_index": 0, "sequence_number": 1,
                "item": {"type": "function_call", "id": "fc_1", "call_id": "call_1",
                         "name": "weather", "arguments": "", "status": "in_progress"}}),
    1.0, named(_ARGUMENTS),
    named({"type": "response.completed", "sequence_number": 3, "response": {
        **_RESPONSE, "status": "completed",
        "usage": {"input_tokens": 5, "output_tokens": 5, "total_tokens": 10}}}),
]  # fmt: skip


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    with (
        serve(scripted_backend(SCRIPTS)) as backend_url,
        serve(create_app(make_policy(backend_url))) as url,
    ):
        yield url


def counters(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of counter `name` on `/metrics`, by their labels."""
    families = text_string_to_metric_families(httpx.get(url + "/metrics").text)
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in families
        for sample in family.samples
        if sample.name == name + "_total"
    }


@pytest.mark.parametrize("script", ["backend-rate-limited", "backend-out-of-credit"])
def test_a_backends_429_is_no_rejection_of_the_gateways(gateway: str, script: str) -> None:
    """`tokenweir_rejected_requests_total` counts the tenant's rate limit and budget: a backend
    that refuses (its own rate limit, its account out of credit) is passed on as a 429 with its
    own code, and is no more the tenant's budget than any other backend error."""
    with openai.OpenAI(base_url=gateway + "/v1", api_key=ALPHA_KEY, max_retries=0) as sdk:
        with pytest.raises(openai.RateLimitError):
            sdk.chat.completions.create(
                model="mock-llm", messages=[{"role": "user", "content": script}]
            )
    requests = counters(gateway, "tokenweir_requests")
    assert sum(v for k, v in requests.items() if ("status_class", "4xx") in k) >= 1
    assert counters(gateway, "tokenweir_rejected_requests") == {}


def histogram(url: str, name: str) -> tuple[float, float]:
    """(count, sum) of histogram `name` on `/metrics`, over every label set."""
    count = total = 0.0
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name + "_count":
                count += sample.value
            elif sample.name == name + "_sum":
                total += sample.value
    return count, total


def test_a_late_textless_finish_event_is_no_gap_between_tokens(
    gateway: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Tokens 0.1 s apart and a finish event with no text 2 s after the last: two gaps of about
    0.1 s, none of 2 s, and 20 tokens/s after the first token (2 gaps over 0.2 s), in the access
    line and in the histograms alike. The bounds leave a loaded machine a second of stalls."""
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    gaps_before = histogram(gateway, "gen_ai_client_operation_time_per_output_chunk_seconds")
    tpot_before = histogram(gateway, "gen_ai_server_time_per_output_token_seconds")
    with openai.OpenAI(base_url=gateway + "/v1", api_key=ALPHA_KEY, max_retries=0) as sdk:
        stream = sdk.chat.completions.create(
            model="mock-llm", messages=[{"role": "user", "content": "late-finish"}], stream=True
        )
        texts = [c.choices[0].delta.content for c in stream if c.choices]
    assert "".join(t or "" for t in texts) == "abc"
    deadline = time.monotonic() + 10
    while not [r for r in caplog.records if r.name == "tokenweir.access"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    [line] = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "tokenweir.access"]
    assert line["output_tokens"] == 3
    assert 80 < line["itl_max_ms"] < 1500, line  # 0.1 s gaps; the 2 s wait for the finish is none
    assert 1.5 < line["tokens_per_s"] <= 40, line  # 2 / 0.2 s = 20; with the finish 2 / 2.2 s
    gaps = histogram(gateway, "gen_ai_client_operation_time_per_output_chunk_seconds")
    count, total = gaps[0] - gaps_before[0], gaps[1] - gaps_before[1]
    assert 1 <= count <= 2  # one a read with text after the first (two unless reads merged)
    assert 0.08 < total < 1.5, total
    tpot = histogram(gateway, "gen_ai_server_time_per_output_token_seconds")
    assert tpot[0] - tpot_before[0] == 1
    assert 0.02 < tpot[1] - tpot_before[1] < 0.65, tpot  # 1 / tokens per s


def test_after_a_fail_over_the_backend_figures_are_the_serving_backends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A backend that fails after 0.8 s, then one that answers at once: the answering backend's
    time to first chunk (access line, span's figures, `backend`-labelled histogram) counts from
    the request sent to it, not from the first attempt's."""
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    scripts: dict[str, Script] = {"quick": [chunk({"content": "a"}), chunk({}, "stop")]}
    with _failing_over(0.8, scripts) as (url, sdk):
        for _ in range(2):  # ties take turns: one of two tries the failing backend first
            list(sdk.chat.completions.create(
                model="mock-llm", messages=[{"role": "user", "content": "quick"}], stream=True,
            ))  # fmt: skip
        deadline = time.monotonic() + 10
        while len([r for r in caplog.records if r.name == "tokenweir.access"]) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        first_chunk = histogram(url, "gen_ai_client_operation_time_to_first_chunk_seconds")
        call = histogram(url, "gen_ai_client_operation_duration_seconds")
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "tokenweir.access"]
    assert [line["backend"] for line in lines] == ["good", "good"]
    assert max(line["duration_ms"] for line in lines) >= 750  # one of them failed over
    assert all(line["upstream_ttft_ms"] < 500 for line in lines), lines
    assert first_chunk[0] == 2
    assert first_chunk[1] < 1.0, first_chunk  # with the failed attempt's wait: at least 1.6 s
    assert call[1] < 1.0, call


def test_after_a_fail_over_the_first_content_deadline_is_the_serving_backends() -> None:
    """A backend that fails after 2 s, then one whose first text comes 2 s after its request
    (keep-alive comments until then), under a 3 s `first_byte_timeout`: the deadline counts
    from the request sent to the serving backend, as documented, not from the first attempt
    (which cut the stream at 3 s)."""
    slow_start: list[bytes | float] = [b": ping\n\n", 0.25] * 8
    slow_start += [chunk({"content": "a"}), chunk({}, "stop")]  # its first event, 2 s on
    scripts: dict[str, Script] = {"slow-start": slow_start}
    upstream = "{first_byte_timeout: 3s, read_timeout: 10s, probe_interval: 0}"
    with _failing_over(2.0, scripts, upstream) as (_, sdk):
        texts = []
        for _ in range(2):  # ties take turns: one of two tries the failing backend first
            chunks = sdk.chat.completions.create(
                model="mock-llm", messages=[{"role": "user", "content": "slow-start"}],
                stream=True,
            )  # fmt: skip
            texts.append("".join(c.choices[0].delta.content or "" for c in chunks))
    assert texts == ["a", "a"]


@contextmanager
def _failing_over(
    fails_after_s: float, scripts: dict[str, Script], upstream: str = "{}"
) -> Iterator[tuple[str, openai.OpenAI]]:
    """A gateway over two backends of one model, taking turns: `bad` answers 500 after
    `fails_after_s`, `good` plays `scripts`. Yields its URL and an SDK client of it."""

    async def failing(request: Request) -> Response:
        await asyncio.sleep(fails_after_s)
        return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, 500)

    with (
        serve(Starlette(routes=[Route("/v1/chat/completions", failing, methods=["POST"])])) as bad,
        serve(scripted_backend(scripts)) as good,
    ):
        policy = parse_policy(
            f"""
storage: memory
upstream: {upstream}
backends:
  - {{name: bad, url: {bad}/v1, models: [mock-llm]}}
  - {{name: good, url: {good}/v1, models: [mock-llm]}}
models: {{mock-llm: {{}}}}
tenants: {{alpha: {{api_keys: [{hash_key(ALPHA_KEY)}], models: [mock-llm]}}}}
""",
            file="failover.yaml",
        )
        with (
            serve(create_app(policy)) as url,
            openai.OpenAI(base_url=url + "/v1", api_key=ALPHA_KEY, max_retries=0) as sdk,
        ):
            yield url, sdk


def access_line(caplog: pytest.LogCaptureFixture) -> dict[str, Any]:
    """The one access log line captured, once it is written (after the answer's end)."""
    deadline = time.monotonic() + 10
    while not [r for r in caplog.records if r.name == "tokenweir.access"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    [line] = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "tokenweir.access"]
    return cast(dict[str, Any], line)


def test_several_choices_of_one_token_have_no_token_rate(
    gateway: str, caplog: pytest.LogCaptureFixture
) -> None:
    """n = 2, one token a choice, 0.05 s apart: tokens/s was (2 - 1) / 0.05 s = 20 (hundreds
    on a fast backend), a speed the backend's routing window took in as well; with no token
    generated after a choice's first there is none."""
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    with openai.OpenAI(base_url=gateway + "/v1", api_key=ALPHA_KEY, max_retries=0) as sdk:
        stream = sdk.chat.completions.create(
            model="mock-llm", messages=[{"role": "user", "content": "two-choices-one-token"}],
            n=2, stream=True,
        )  # fmt: skip
        texts = [(c.choices[0].index, c.choices[0].delta.content) for c in stream if c.choices]
    assert [text for text in texts if text[1]] == [(0, "a"), (1, "b")]
    line = access_line(caplog)
    assert line["output_tokens"] == 2
    assert line["tokens_per_s"] is None, line


@pytest.mark.parametrize("script", ["textless-between", "textless-between-no-usage"])
def test_events_without_text_between_tokens_are_no_gaps(
    gateway: str, script: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Tokens 0.2 s apart with an event without text 0.1 s after each: three gaps of about
    0.2 s between the four tokens (they were six of 0.1 s: a p50 half the real one), in the
    access line and the histogram alike; without usage the events without text are no longer
    billed (tests/web/test_own_counts.py)."""
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    name = "gen_ai_client_operation_time_per_output_chunk_seconds"
    before = histogram(gateway, name)
    with openai.OpenAI(base_url=gateway + "/v1", api_key=ALPHA_KEY, max_retries=0) as sdk:
        stream = sdk.chat.completions.create(
            model="mock-llm", messages=[{"role": "user", "content": script}], stream=True
        )
        texts = [c.choices[0].delta and c.choices[0].delta.content for c in stream if c.choices]
    assert "".join(t or "" for t in texts) == "abcd"
    line = access_line(caplog)
    if script.endswith("no-usage"):  # the estimate: the events of the reads with text (the
        # events without text were billed too, 7), the finish when it shares "d"'s read
        assert line["output_tokens"] in (4, 5), line
    gaps = histogram(gateway, name)
    assert gaps[0] - before[0] == 3  # one a token after the first (reads 0.1 s apart)
    # First token to last, 0.6 s as sent: a loaded machine that reads the first token late
    # shortens it (0.536 s seen at a load of 13), so the floor is wide; the count above and
    # the p50 below are what tell 0.2 s gaps from 0.1 s ones.
    assert gaps[1] - before[1] > 0.35
    assert 150 < line["itl_p50_ms"] < 1500, line  # 0.2 s (0.1 s when the events were gaps)
    span_s = (line["output_tokens"] - 1) / line["tokens_per_s"]
    assert 0.35 < span_s < 1.5, line


@pytest.mark.parametrize("script", ["tool-call", "refusal"])
def test_the_first_token_is_a_tool_calls_name_or_a_refusal(
    gateway: str, script: str, caplog: pytest.LogCaptureFixture
) -> None:
    """TTFT ends at the event with the function's name (0.3 s), not at the first argument
    piece 1 s after it, and at a refusal's first piece (a refusal had none); the tool call's
    bill is as before: its argument events and finish, less the finish."""
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    with openai.OpenAI(base_url=gateway + "/v1", api_key=ALPHA_KEY, max_retries=0) as sdk:
        stream = sdk.chat.completions.create(
            model="mock-llm", messages=[{"role": "user", "content": script}], stream=True,
            tools=[{"type": "function", "function": {"name": "weather"}}],
        )  # fmt: skip
        chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("tool_calls", "stop")
    line = access_line(caplog)
    assert 250 < line["ttft_ms"] < 1000, line  # 0.3 s; the first argument came at 1.3 s
    if script == "tool-call":
        assert line["output_tokens"] == 2, line


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/messages", {"max_tokens": 50, "messages": [
            {"role": "user", "content": "messages-tool-call"}]}),
        ("/v1/responses", {"input": "responses-tool-call"}),
    ],
)  # fmt: skip
def test_on_the_agent_apis_the_first_token_is_a_tool_calls_name(
    gateway: str, path: str, body: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """As on chat, TTFT ends at the event naming the tool call (0.3 s), not at its first
    argument piece 1 s later (a Messages stream's first, empty, piece is no text either)."""
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    headers = {"authorization": f"Bearer {ALPHA_KEY}", **_ANTHROPIC}
    request = {"model": "mock-llm", "stream": True, **body}
    with httpx.stream("POST", gateway + path, json=request, headers=headers, timeout=30) as answer:
        assert answer.status_code == 200
        raw = b"".join(answer.iter_raw())
    assert b'{\\"city\\":\\"Paris\\"}' in raw
    line = access_line(caplog)
    assert line["output_tokens"] == 5, line
    assert 250 < line["ttft_ms"] < 1000, line  # 0.3 s; the arguments came at 1.3 s
