"""Timing and counting of one bench request, over a transport that replays recorded bytes."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from time import perf_counter
from unittest import mock

import pytest

from proxy.tools.bench import sse
from proxy.tools.bench.client import EVENTS, TOKENIZER, USAGE, RequestSample, RequestSender
from proxy.tools.bench.config import MAX_CONTENT_EVENTS, BenchConfig
from proxy.tools.bench.level import summarize_level
from proxy.tools.bench.prompts import Tokenizer
from proxy.tools.bench.transport import ResponseSink, TransportFailure


def chunk(text: str) -> bytes:
    return b'data: {"choices":[{"index":0,"delta":{"content":"%b"}}],"usage":null}\n\n' % (
        text.encode()
    )


ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
DONE = b"data: [DONE]\n\n"


def usage(completion_tokens: int) -> bytes:
    return b'data: {"choices":[],"usage":{"completion_tokens":%d}}\n\n' % completion_tokens


class ReplayTransport:
    """Delivers (offset_s, bytes) reads stamped at request start + offset, without sleeping."""

    def __init__(
        self,
        reads: Sequence[tuple[float, bytes]],
        *,
        status: int = 200,
        failure: TransportFailure | None = None,
        hang: bool = False,
    ) -> None:
        self.reads = reads
        self.status = status
        self.failure = failure
        self.hang = hang

    async def exchange(self, body: bytes, sink: ResponseSink) -> None:
        start_s = perf_counter()
        sink.on_status(self.status)
        for offset_s, data in self.reads:
            sink.on_body(data, start_s + offset_s)
        if self.failure is not None:
            raise self.failure
        if self.hang:
            await asyncio.Event().wait()

    async def aclose(self) -> None:
        return None


WORDS = Tokenizer(
    name="words", encode=lambda text: list(range(len(text.split()))), decode=lambda ids: ""
)


def send(
    transport: ReplayTransport,
    *,
    stream: bool = True,
    tokenizer: Tokenizer | None = None,
    timeout_s: float = 5.0,
    max_events: int = 1_000,
) -> RequestSample:
    sender = RequestSender(transport, tokenizer, timeout_s, max_events=max_events)
    return asyncio.run(sender.send(b"{}", stream=stream))


def send_timed(
    transport: ReplayTransport, *, tokenizer: Tokenizer | None = None
) -> tuple[RequestSample, float]:
    """The sample, and the seconds `send` took (the transport does not sleep: its reads are
    stamped, so this is only the machine's own time)."""
    began = perf_counter()
    sample = send(transport, tokenizer=tokenizer)
    return sample, perf_counter() - began


def assert_first_token_at(sample: RequestSample, offset_s: float, elapsed_s: float) -> None:
    """TTFT is the first token's read offset plus the moment between the sender's start and
    the transport's: never less, and no more than the whole send took (a loaded machine made
    that 2.6 ms, past a 1 ms tolerance)."""
    assert sample.ttft_s is not None
    assert offset_s - 1e-9 <= sample.ttft_s <= offset_s + elapsed_s


def timed_stream(tokens: int, *, ttft_s: float, gap_s: float) -> list[tuple[float, bytes]]:
    reads = [(0.05, ROLE)]
    reads += [(ttft_s + i * gap_s, chunk(f"w{i} ")) for i in range(tokens)]
    return reads


def test_ttft_itl_and_speed_after_the_first_token() -> None:
    reads = [*timed_stream(5, ttft_s=0.2, gap_s=0.01), (0.25, usage(5) + DONE)]
    sample, elapsed_s = send_timed(ReplayTransport(reads))
    assert sample.error is None
    assert_first_token_at(sample, 0.2, elapsed_s)
    assert sample.gaps_s == pytest.approx([0.01] * 4)
    assert (sample.output_tokens, sample.token_source) == (5, USAGE)
    # (5 - 1) tokens over the 0.04 s from first to last: TTFT is not in it
    assert sample.stream_tokens_per_s == pytest.approx(100.0)


def test_usage_counts_tokens_when_events_carry_several() -> None:
    reads = [*timed_stream(3, ttft_s=0.1, gap_s=0.1), (0.3, usage(9)), (0.3, DONE)]
    sample = send(ReplayTransport(reads))
    assert sample.content_events == 3
    assert sample.output_tokens == 9
    assert sample.stream_tokens_per_s == pytest.approx(8 / 0.2)


def test_streamed_reasoning_stays_in_the_stream_speed() -> None:
    # Reasoning a server streams (vLLM's reasoning_content) is timed like any text, so usage's
    # reasoning tokens stay in the per-stream speed; reasoning never streamed does not.
    think = b'data: {"choices":[{"delta":{"reasoning_content":"hm "}}]}\n\n'
    details = b'"completion_tokens_details":{"reasoning_tokens":2}'
    usage_chunk = b'data: {"choices":[],"usage":{"completion_tokens":6,%b}}\n\n' % details
    reads = [(0.1, think), (0.2, think), (0.3, chunk("a")), (0.4, chunk("b")), (0.5, usage_chunk)]
    sample = send(ReplayTransport([*reads, (0.5, DONE)]))
    assert (sample.output_tokens, sample.unstreamed_tokens) == (6, 0)
    assert sample.stream_tokens_per_s == pytest.approx(5 / 0.3)
    hidden = send(ReplayTransport([*reads[2:], (0.5, DONE)]))
    assert (hidden.output_tokens, hidden.unstreamed_tokens) == (6, 2)
    assert hidden.stream_tokens_per_s == pytest.approx(3 / 0.1)


def test_without_usage_a_tokenizer_counts_the_text() -> None:
    reads = [*timed_stream(4, ttft_s=0.1, gap_s=0.01), (0.2, DONE)]
    sample = send(ReplayTransport(reads), tokenizer=WORDS)
    assert (sample.output_tokens, sample.token_source) == (4, TOKENIZER)


def test_without_usage_or_tokenizer_events_are_counted_and_labelled() -> None:
    reads = [*timed_stream(4, ttft_s=0.1, gap_s=0.01), (0.2, DONE)]
    sample = send(ReplayTransport(reads))
    assert (sample.output_tokens, sample.token_source) == (4, EVENTS)
    assert sample.token_source == "events (no usage, no tokenizer)"


def tool_call(function: bytes) -> bytes:
    return b'data: {"choices":[{"delta":{"tool_calls":[{"index":0,"function":%b}]}}]}\n\n' % (
        function
    )


def test_a_tool_calls_first_token_is_its_function_name() -> None:
    """OpenAI streams a tool call as its name (arguments "") and then argument pieces."""
    reads = [(0.05, ROLE), (0.2, tool_call(b'{"name":"get_weather","arguments":""}'))]
    reads += [(0.3, tool_call(b'{"arguments":" {}"}')), (0.4, DONE)]
    sample, elapsed_s = send_timed(ReplayTransport(reads), tokenizer=WORDS)
    assert_first_token_at(sample, 0.2, elapsed_s)
    assert sample.gaps_s == pytest.approx([0.1])
    assert sample.output_tokens == 2  # "get_weather" and "{}", one word each
    sample = send(ReplayTransport(reads))
    assert (sample.content_events, sample.output_tokens) == (2, 2)


def test_a_streamed_refusal_is_generated_text() -> None:
    refusal = b'data: {"choices":[{"delta":{"refusal":"I cannot "}}]}\n\n'
    reads = [(0.2, refusal), (0.3, refusal + DONE)]
    sample, elapsed_s = send_timed(ReplayTransport(reads), tokenizer=WORDS)
    assert_first_token_at(sample, 0.2, elapsed_s)
    assert sample.output_tokens == 4


def test_coalesced_reads_share_one_arrival_time() -> None:
    reads = [(0.1, chunk("a") + chunk("b")), (0.2, chunk("c") + usage(3) + DONE)]
    sample = send(ReplayTransport(reads))
    assert sample.gaps_s == pytest.approx([0.0, 0.1])
    assert sample.stream_tokens_per_s == pytest.approx(2 / 0.1)


def test_error_event_in_the_stream() -> None:
    error = b'data: {"error":{"message":"model overloaded"}}\n\n'
    sample = send(ReplayTransport([(0.1, chunk("a")), (0.2, error), (0.2, DONE)]))
    assert (sample.error, sample.error_detail) == ("stream_error", "model overloaded")


def test_a_null_error_field_in_every_chunk_is_a_success() -> None:
    """The stream and the whole answer of a server that sends `"error": null` are ok."""
    content = b'data: {"choices":[{"delta":{"content":"a"}}],"error":null}\n\n'
    sample = send(ReplayTransport([(0.1, content), (0.2, content + usage(2) + DONE)]))
    assert (sample.error, sample.error_detail, sample.output_tokens) == (None, None, 2)
    answer = b'{"choices":[{"message":{"content":"a"}}],"usage":{"completion_tokens":1},'
    answer += b'"error":null}'
    sample = send(ReplayTransport([(0.1, answer)]), stream=False)
    assert (sample.error, sample.output_tokens) == (None, 1)


def test_http_error_status_keeps_the_body_as_detail() -> None:
    body = b'{"error":{"message":"slow down"}}'
    sample = send(ReplayTransport([(0.01, body)], status=429))
    assert sample.error == "http_429"
    assert "slow down" in (sample.error_detail or "")


def test_stream_without_done_is_incomplete() -> None:
    sample = send(ReplayTransport([(0.1, chunk("a"))]))
    assert sample.error == "incomplete"


def test_an_event_past_the_parsers_limit_fails_the_request_but_the_rest_is_read() -> None:
    long = [(0.1, b"data: " + b"x" * 4000)] + [(0.1, b"x" * 1000) for _ in range(10)]
    reads = [(0.05, chunk("a")), *long, (0.2, b"\n\n" + chunk("b") + usage(2) + DONE)]
    with mock.patch.object(sse, "MAX_EVENT_BYTES", 10_000):
        sample = send(ReplayTransport(reads))
    assert sample.error == "oversized_event"
    assert "1 event(s)" in (sample.error_detail or "")
    assert (sample.content_events, sample.output_tokens) == (2, 2)


def test_a_stream_past_its_max_tokens_is_an_error_and_keeps_only_what_was_asked() -> None:
    # A server ignoring max_tokens (or an endless one) grew the bench ~20 MB a second: every
    # gap and, with a tokenizer, every payload was kept until the timeout.
    reads = [(0.1 + i / 1000, chunk(f"w{i} ")) for i in range(500)] + [(0.7, DONE)]
    sample = send(ReplayTransport(reads), tokenizer=WORDS, max_events=20)
    assert sample.error == "too_many_events"
    assert "500 content events, more than the 20" in (sample.error_detail or "")
    assert sample.content_events == 500
    assert len(sample.gaps_s) == 19
    assert sample.output_tokens == 20  # the tokenizer read the 20 kept


def test_a_config_bounds_events_by_what_it_asks_for() -> None:
    config = BenchConfig(base_url="http://h/v1", model="m", max_tokens=100)
    assert config.max_events == 4 * 100 + 64
    asked_more = {"max_completion_tokens": 300, "n": 2}
    assert replace(config, extra_body=asked_more).max_events == 4 * 300 * 2 + 64
    junk = {"max_tokens": "9" * 40, "n": -3}
    assert replace(config, extra_body=junk).max_events == 4 * 100 + 64
    huge = {"max_tokens": 10**12}
    assert replace(config, extra_body=huge).max_events == MAX_CONTENT_EVENTS


def test_transport_failure_and_timeout() -> None:
    failure = TransportFailure("connection", "connection closed by the server")
    sample = send(ReplayTransport([(0.1, chunk("a"))], failure=failure))
    assert (sample.error, sample.error_detail) == ("connection", "connection closed by the server")
    sample = send(ReplayTransport([], hang=True), timeout_s=0.05)
    assert sample.error == "timeout"
    assert 0.04 < sample.e2e_s < 1.0  # cut at the timeout, not later; loaded, 0.125 s was seen


def test_non_stream_answers() -> None:
    answer = b'{"choices":[{"message":{"content":"a b c"}}],"usage":{"completion_tokens":3}}'
    sample = send(ReplayTransport([(0.3, answer)]), stream=False)
    assert (sample.error, sample.output_tokens, sample.token_source) == (None, 3, USAGE)
    assert sample.ttft_s is None
    assert sample.stream_tokens_per_s is None
    no_usage = b'{"choices":[{"message":{"content":"a b c d"}}]}'
    sample = send(ReplayTransport([(0.3, no_usage)]), stream=False, tokenizer=WORDS)
    assert (sample.output_tokens, sample.token_source) == (4, TOKENIZER)
    assert send(ReplayTransport([(0.1, b"<html>")]), stream=False).error == "bad_response"
    error = b'{"error":{"message":"bad"}}'
    assert send(ReplayTransport([(0.1, error)]), stream=False).error == "error_body"
    assert send(ReplayTransport([(0.1, error)], status=500), stream=False).error == "http_500"


def test_level_summary_counts_errors_and_uses_the_weakest_token_source() -> None:
    def ok(start_s: float, end_s: float, tokens: int, source: str) -> RequestSample:
        sample = RequestSample(start_s=start_s, end_s=end_s, output_tokens=tokens)
        sample.token_source = source
        sample.first_token_s, sample.last_token_s = start_s + 0.1, start_s + 0.1 + 0.01 * tokens
        return sample

    samples = [
        ok(0.0, 1.0, 10, USAGE),
        ok(0.0, 2.0, 20, EVENTS),
        RequestSample(start_s=0.5, end_s=0.6, error="http_503", error_detail="busy"),
        RequestSample(start_s=0.5, end_s=0.7, error="http_503"),
        RequestSample(start_s=0.5, end_s=0.8, error="timeout"),
    ]
    level = summarize_level(2, samples, start_s=0.0, cpu_fraction=0.5)
    assert (level.requests, level.ok) == (5, 2)
    assert level.errors == {"http_503": 2, "timeout": 1}
    assert level.error_examples["http_503"] == "busy"
    assert level.wall_s == pytest.approx(2.0)
    assert level.requests_per_s == pytest.approx(1.0)
    assert level.output_tokens == 30
    assert level.aggregate_tokens_per_s == pytest.approx(15.0)
    assert level.token_source == EVENTS
    assert level.stream_tokens_per_s.p50 == pytest.approx((90.0 + 95.0) / 2)  # 9/0.1, 19/0.2
    assert level.verdict == "50-150 tok/s: readable streaming"
