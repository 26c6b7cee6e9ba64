"""`tokenweir bench` against a raw server whose every event and pause is known: what it reports
is what the server did (timings with wide margins, for a loaded machine; counts exactly)."""

from __future__ import annotations

import asyncio

import pytest

from proxy.tools.bench.client import EVENTS, TOKENIZER, USAGE
from proxy.tools.bench.level import LevelResult, run_level
from proxy.tools.bench.prompts import build_workload
from proxy.tools.bench.run import BenchConfig, main
from proxy.tools.bench.sse import MAX_EVENT_BYTES
from tests.tools.test_bench import parse
from tests.tools.test_benchclient import WORDS
from tests.tools.test_benchwire import Handler, read_request, server

TTFT_S = 0.3  # the role chunk comes at once; the first token this long after the request
GAP_S = 0.05
TOKENS = 5
STALL_S = 0.4  # before the finish chunk, and again before usage and [DONE]


def truth_server(*, usage: bool, newline: bytes) -> Handler:
    def event(data: bytes) -> bytes:
        return b"data: " + data + newline + newline

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while await read_request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
            writer.write(event(b'{"choices":[{"delta":{"role":"assistant","content":""}}]}'))
            await writer.drain()
            await asyncio.sleep(TTFT_S)
            for i in range(TOKENS):
                await asyncio.sleep(GAP_S if i else 0)
                writer.write(event(b'{"choices":[{"delta":{"content":"w "}}],"usage":null}'))
                await writer.drain()
            await asyncio.sleep(STALL_S)
            writer.write(event(b'{"choices":[{"delta":{},"finish_reason":"stop"}]}'))
            await writer.drain()
            await asyncio.sleep(STALL_S)
            if usage:
                writer.write(event(b'{"choices":[],"usage":{"completion_tokens":%d}}' % TOKENS))
            writer.write(event(b"[DONE]"))
            writer.close()  # the body ends with the connection: no length, not chunked
            return

    return handle


async def measure(*, usage: bool, newline: bytes, requests: int) -> LevelResult:
    async with server(truth_server(usage=usage, newline=newline)) as url:
        base_url = url.removesuffix("/chat/completions")
        config = BenchConfig(base_url=base_url, model="m", requests=requests)
        return await run_level(config, 2)


@pytest.mark.parametrize(("usage", "newline"), [(True, b"\n"), (False, b"\r\n")])
def test_figures_are_what_the_server_did(usage: bool, newline: bytes) -> None:
    level = asyncio.run(measure(usage=usage, newline=newline, requests=4))
    assert (level.requests, level.ok, level.errors) == (4, 4, {})
    # Tokens: from usage when sent, else one per content event; the role chunk, the finish
    # chunk, the usage chunk and [DONE] are none.
    assert (level.output_tokens, level.token_source) == (4 * TOKENS, USAGE if usage else EVENTS)
    # Gaps only between the 5 token events: none from the role chunk or the stalls after.
    assert level.itl_s.count == 4 * (TOKENS - 1)
    assert (level.itl_s.max or 0) < STALL_S
    # TTFT from the request's start to the first token, not to the role chunk's first byte.
    assert TTFT_S * 0.8 <= (level.ttft_s.min or 0) <= (level.ttft_s.max or 0) < 2.0
    # The stalls after the last token are in e2e, not in the per-stream speed.
    assert (level.e2e_s.min or 0) >= TTFT_S + 2 * STALL_S
    span_s = GAP_S * (TOKENS - 1)
    speed = level.stream_tokens_per_s.p50 or 0
    assert (TOKENS - 1) / (span_s + STALL_S) < speed <= (TOKENS - 1) / (span_s * 0.5)
    assert level.wall_s >= 2 * level.e2e_s.min  # type: ignore[operator]
    assert level.requests_per_s == pytest.approx(4 / level.wall_s)
    assert level.aggregate_tokens_per_s == pytest.approx(4 * TOKENS / level.wall_s)


def usage_server(completion_tokens: bytes) -> Handler:
    """Answers streams and whole answers of TOKENS words, with this `usage.completion_tokens`."""
    usage = b'"usage":{"completion_tokens":%b}' % completion_tokens
    event = b'data: {"choices":[{"delta":{"content":"w "}}]}\n\n'
    stream = event * TOKENS + b'data: {"choices":[],%b}\n\ndata: [DONE]\n\n' % usage
    whole = b'{"choices":[{"message":{"content":"%b"}}],%b}' % (b"w " * TOKENS, usage)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while (request := await read_request(reader)) is not None:
            body = stream if b'"stream":true' in request[1] else whole
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
            await writer.drain()

    return handle


async def measure_usage(completion_tokens: bytes, *, stream: bool) -> LevelResult:
    async with server(usage_server(completion_tokens)) as url:
        base_url = url.removesuffix("/chat/completions")
        config = BenchConfig(base_url=base_url, model="m", requests=3, stream=stream)
        return await run_level(config, 1, workload=build_workload(config, WORDS))


@pytest.mark.parametrize("completion_tokens", [b"-1000", b"1000000000000000", b"0", b"true"])
@pytest.mark.parametrize("stream", [True, False])
def test_a_usage_no_answer_can_have_is_not_believed(completion_tokens: bytes, stream: bool) -> None:
    # A negative count once made a negative tokens/s, a huge one a figure of 10**17 tok/s, and
    # 0 beside five words of text 0 tok/s: the answer's text is counted instead.
    level = asyncio.run(measure_usage(completion_tokens, stream=stream))
    assert (level.ok, level.output_tokens, level.token_source) == (3, 3 * TOKENS, TOKENIZER)
    assert level.aggregate_tokens_per_s == pytest.approx(3 * TOKENS / level.wall_s)


def test_an_error_body_cannot_write_lines_or_escapes_into_the_report(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The body's newline once began a line of the server's making in the table (a verdict it
    # chose), and its escape sequences reached the terminal (a title, a colour).
    forged = "concurrency 1: median stream speed >=750 tok/s: 750-class deployment"
    detail = f"oops\x1b]0;pwned\x07\x1b[31m\n{forged}".encode()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while await read_request(reader) is not None:
            writer.write(
                b"HTTP/1.1 500 Oops\r\nContent-Length: %d\r\n\r\n%b" % (len(detail), detail)
            )
            await writer.drain()

    async def bench(argv: list[str]) -> int:
        async with server(handle) as url:
            base = ["--base-url", url.removesuffix("/chat/completions"), "--model", "m"]
            return await asyncio.to_thread(main, parse([*base, *argv]))

    assert asyncio.run(bench(["--concurrency", "1", "--requests", "1"])) == 1
    out = capsys.readouterr().out
    assert "\x1b" not in out
    assert "\x07" not in out
    assert f"1 x http_500: oops\\x1b]0;pwned\\x07\\x1b[31m\\n{forged}" in out
    assert [line for line in out.splitlines() if line.startswith("concurrency 1:")] == [
        "concurrency 1: median stream speed n/a: no per-stream speed measured (needs streaming "
        "and 2+ output tokens)"
    ]


async def measure_whole(answer: bytes, *, requests: int) -> LevelResult:
    """A --no-stream level against a server that answers every request 200 with `answer`."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while await read_request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(answer), answer))
            await writer.drain()

    async with server(handle) as url:
        base_url = url.removesuffix("/chat/completions")
        config = BenchConfig(base_url=base_url, model="m", requests=requests, stream=False)
        return await run_level(config, 1)


@pytest.mark.parametrize(
    "answer", [b"{}", b"[]", b"null", b'"ok"', b'{"object":"error","message":"no model loaded"}']
)
def test_a_whole_answer_that_is_no_chat_completion_is_a_bad_response(answer: bytes) -> None:
    # Each was counted as a successful request, its figures in requests/s and e2e.
    level = asyncio.run(measure_whole(answer, requests=2))
    assert (level.ok, level.errors, level.requests_per_s) == (0, {"bad_response": 2}, 0.0)


def test_reasoning_a_server_counts_but_never_streams_is_not_in_the_stream_speed() -> None:
    # OpenAI's reasoning models think before the first visible token and count those tokens in
    # usage: 5 tokens streamed over 0.2 s with 1,000 more in usage read as 5,000 tok/s a stream.
    usage = b'{"choices":[],"usage":{"completion_tokens":1005,"completion_tokens_details":'
    usage += b'{"reasoning_tokens":1000}}}'

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while await read_request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            await asyncio.sleep(TTFT_S)
            for i in range(TOKENS):
                await asyncio.sleep(GAP_S if i else 0)
                writer.write(chunked_part(b'data: {"choices":[{"delta":{"content":"w "}}]}\n\n'))
                await writer.drain()
            writer.write(chunked_part(b"data: %b\n\ndata: [DONE]\n\n" % usage) + b"0\r\n\r\n")
            await writer.drain()

    async def measure() -> LevelResult:
        async with server(handle) as url:
            base_url = url.removesuffix("/chat/completions")
            return await run_level(BenchConfig(base_url=base_url, model="m", requests=2), 1)

    level = asyncio.run(measure())
    assert (level.ok, level.output_tokens, level.token_source) == (2, 2 * 1005, USAGE)
    span_s = GAP_S * (TOKENS - 1)  # 4 tokens after the first in 0.2 s: 20 tok/s
    assert (TOKENS - 1) / (span_s + 2.0) < (level.stream_tokens_per_s.max or 0) < 100


def chunked_part(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def test_a_whole_answer_past_the_limit_is_dropped_in_bounded_memory() -> None:
    # The whole-answer sink held every byte: an endless body grew the bench by 0.5 GB a second
    # until the request's timeout. Now past MAX_EVENT_BYTES the rest is dropped unread.
    content = b"a" * MAX_EVENT_BYTES
    answer = b'{"choices":[{"message":{"content":"%b"}}]}' % content
    level = asyncio.run(measure_whole(answer, requests=1))
    assert (level.ok, level.errors) == (0, {"oversized_response": 1})
    assert level.error_examples["oversized_response"] == (
        f"more than {MAX_EVENT_BYTES:,} bytes, dropped unread"
    )
