"""The incremental SSE parser and the cheap chunk inspectors of the bench."""

from __future__ import annotations

import itertools
import random
import tracemalloc
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.tools.bench import sse
from proxy.tools.bench.sse import (
    SseEvent,
    SseParser,
    content_text,
    error_message,
    has_content,
    is_done,
    usage_completion_tokens,
)

ROLE = b'{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}],"usage":null}'
TOKENS = [
    b'{"choices":[{"index":0,"delta":{"content":"w%d "}}],"usage":null}' % i for i in range(5)
]
USAGE = b'{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":5,"total_tokens":17}}'
PAYLOADS = [ROLE, *TOKENS, USAGE, b"[DONE]"]
STREAM = b"".join(b"data: " + payload + b"\n\n" for payload in PAYLOADS)


def feed_all(chunks: list[bytes]) -> list[SseEvent]:
    parser = SseParser()
    events = [event for chunk in chunks for event in parser.feed(chunk)]
    return events + parser.flush()


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted(cuts), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def test_whole_stream_in_one_read() -> None:
    assert [event.data for event in feed_all([STREAM])] == PAYLOADS


def test_every_single_split_point() -> None:
    for cut in range(len(STREAM) + 1):
        assert [event.data for event in feed_all(split_at(STREAM, [cut]))] == PAYLOADS, cut


def test_byte_by_byte() -> None:
    chunks = [STREAM[i : i + 1] for i in range(len(STREAM))]
    assert [event.data for event in feed_all(chunks)] == PAYLOADS


@pytest.mark.parametrize("newline", [b"\r\n", b"\r"])
def test_crlf_and_cr_line_endings_at_random_boundaries(newline: bytes) -> None:
    stream = STREAM.replace(b"\n", newline)
    rng = random.Random(7)  # noqa: S311 (reproducible read boundaries)
    for _ in range(200):
        cuts = rng.sample(range(len(stream)), k=rng.randint(1, 12))
        assert [event.data for event in feed_all(split_at(stream, cuts))] == PAYLOADS


def test_crlf_split_between_cr_and_lf() -> None:
    first, second = b"data: a\r\n\r", b"\ndata: b\r\n\r\n"
    parser = SseParser()
    assert [event.data for event in parser.feed(first)] == []
    assert [event.data for event in parser.feed(second)] == [b"a", b"b"]


def test_coalesced_events_in_one_read() -> None:
    parser = SseParser()
    events = parser.feed(b"data: 1\n\ndata: 2\n\ndata: 3\n\ndata: 4")
    assert [event.data for event in events] == [b"1", b"2", b"3"]
    assert [event.data for event in parser.feed(b"\n\n")] == [b"4"]


def test_comments_and_keepalives_are_not_events() -> None:
    stream = b": ping\n\n:\n\ndata: x\n: inline comment\n\n\n\n: keep-alive\n\n"
    assert [event.data for event in feed_all([stream])] == [b"x"]


def test_event_type_multiline_data_and_no_space_after_colon() -> None:
    events = feed_all([b'event: error\ndata:{"a":\ndata: 1}\nid: 3\nretry: 10\n\n'])
    assert events == [SseEvent(data=b'{"a":\n1}', event=b"error")]


def test_flush_returns_an_unterminated_last_event() -> None:
    assert [event.data for event in feed_all([b"data: 1\n\ndata: [DONE]\r\n"])] == [
        b"1",
        b"[DONE]",
    ]
    assert feed_all([b"data: 1\n\n: trailing comment"]) == [SseEvent(data=b"1")]


_LINE_ENDS = st.sampled_from([b"\n", b"\r\n", b"\r"])


@st.composite
def mixed_streams(draw: st.DrawFn) -> bytes:
    """Events of data lines (short or long), comments and an `event:` field, each line ended
    by its own LF, CRLF or CR (the spec allows any mix), events ended by a blank line."""
    out = []
    for _ in range(draw(st.integers(1, 6))):
        lines = [b": keep-alive"] if draw(st.booleans()) else []
        if draw(st.booleans()):
            lines.append(b"event: " + draw(st.sampled_from([b"ping", b"error"])))
        for _ in range(draw(st.integers(1, 3))):
            lines.append(b"data: " + b"x" * draw(st.sampled_from([0, 3, 40, 300])))
        lines.append(b"")  # the blank line
        out += [line + draw(_LINE_ENDS) for line in lines]
    return b"".join(out)


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(
    stream=mixed_streams(),
    data=st.data(),
    join_below=st.sampled_from([1, 8, sse._JOIN_BELOW]),
)
def test_any_stream_cut_anywhere_gives_the_events_of_one_read(
    stream: bytes, data: st.DataObject, join_below: int
) -> None:
    """Held starts short (joined to each read) or long (kept in pieces, only the new read and
    the bytes before it searched): the same events however the reads cut the stream."""
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=20))
    whole = feed_all([stream])
    with mock.patch.object(sse, "_JOIN_BELOW", join_below):
        for reads in (split_at(stream, cuts), [stream[i : i + 1] for i in range(len(stream))]):
            parser, events, read = SseParser(), [], b""
            for piece in reads:  # each event as soon as its blank line is read, not later
                events += parser.feed(piece)
                read += piece
                assert events == SseParser().feed(read)
            assert events + parser.flush() == whole


def test_a_long_event_trickled_in_small_reads_comes_out_whole() -> None:
    long = b'{"choices":[{"delta":{"content":"' + b"x" * (3 * sse._JOIN_BELOW) + b'"}}]}'
    for end in (b"\n\n", b"\r\n\r\n", b"\r\r", b"\n\r\n"):
        stream = b"data: " + long + end + b"data: [DONE]" + end
        reads = [stream[i : i + 100] for i in range(0, len(stream), 100)]
        assert [event.data for event in feed_all(reads)] == [long, b"[DONE]"]


@pytest.mark.parametrize(
    "ending",
    [
        [b"yy\r\n\r\ndata: 3\r\n\r\ndata: 4"],
        [b"yy\r\n", b"\r\ndata: 3\r\n\r\ndata: 4"],
        [b"yy\r", b"\n", b"\r", b"\ndata: 3\r\n\r\ndata: 4"],
        [b"yy\n", b"\ndata: 3\n\ndata: 4"],
        [b"yy\r", b"\rdata: 3\r\rdata: 4"],
    ],
)
def test_an_event_past_the_limit_is_dropped_in_bounded_memory_and_the_next_ones_parsed(
    ending: list[bytes],
) -> None:
    parser = SseParser()
    with mock.patch.object(sse, "MAX_EVENT_BYTES", 1 << 16):
        assert [event.data for event in parser.feed(b"data: 1\n\ndata: 2")] == [b"1"]
        tracemalloc.start()
        try:
            for _ in range(2000):  # 20 MB of one event that has not ended
                assert parser.feed(b"y" * 10_000) == []
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20
        ended = [event.data for read in ending for event in parser.feed(read)]
        assert ended == [b"3"]
        assert [event.data for event in parser.flush()] == [b"4"]
    assert parser.dropped == 1


def test_done_sentinel() -> None:
    assert is_done(b"[DONE]")
    assert is_done(b" [DONE] ")
    assert not is_done(TOKENS[0])


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (ROLE, False),
        (TOKENS[0], True),
        (USAGE, False),
        (b'{"choices":[{"delta":{"content":null}}]}', False),
        (b'{"choices":[{"delta":{"content": "x"}}]}', True),
        (b'{"choices":[{"delta":{"content":"\\"quoted\\""}}]}', True),
        (b'{"choices":[{"delta":{"reasoning_content":"think"}}]}', True),
        (b'{"choices":[{"delta":{"tool_calls":[{"function":{"arguments":"{"}}]}}]}', True),
        (b'{"choices":[{"text":"completion","index":0}]}', True),
        # a tool call's first event names the function: the model's first tokens
        (
            b'{"choices":[{"delta":{"tool_calls":[{"function":{"name":"f","arguments":""}}]}}]}',
            True,
        ),
        (b'{"choices":[{"delta":{"refusal":"I cannot"}}]}', True),
        # text that only mentions a content key is escaped inside its string
        (b'{"choices":[{"delta":{"content":""}}],"note":"\\"content\\":\\"x\\""}', False),
    ],
)
def test_has_content(data: bytes, expected: bool) -> None:
    assert has_content(data) is expected


def test_usage_tokens_only_from_a_usage_object() -> None:
    assert usage_completion_tokens(USAGE) == 5
    assert usage_completion_tokens(ROLE) is None  # "usage": null
    assert usage_completion_tokens(TOKENS[0]) is None
    with_content = b'{"choices":[{"delta":{"content":"z"}}],"usage": {"completion_tokens": 9}}'
    assert usage_completion_tokens(with_content) == 9
    assert usage_completion_tokens(b'{"usage":{"completion_tokens":"9"}}') is None


def test_error_events() -> None:
    body = b'{"error":{"message":"overloaded","type":"server_error"}}'
    assert error_message(SseEvent(data=body)) == "overloaded"
    assert error_message(SseEvent(data=b"boom", event=b"error")) == "boom"
    assert error_message(SseEvent(data=b'{"message":"x"}', event=b"error")) == "x"
    assert error_message(SseEvent(data=TOKENS[0])) is None
    assert error_message(SseEvent(data=b'{"choices":[{"finish_reason":"error"}]}')) is None


def test_a_null_error_field_is_no_error() -> None:
    """Some servers put `"error": null` in every chunk and answer; that is a success."""
    ok = b'{"choices":[{"delta":{"content":"a"}}],"error":null}'
    assert error_message(SseEvent(data=ok)) is None
    assert error_message(SseEvent(data=b'{"error":{"code":500}}')) == '{"error":{"code":500}}'
    assert error_message(SseEvent(data=b'"overloaded"', event=b"error")) == "overloaded"
    assert error_message(SseEvent(data=b"42", event=b"error")) == "42"
    assert error_message(SseEvent(data=b'{"error":null}', event=b"error")) == '{"error":null}'


def test_content_text_of_chat_completion_and_message_shapes() -> None:
    assert content_text(TOKENS[1]) == "w1 "
    assert content_text(b'{"choices":[{"message":{"content":"whole answer"}}]}') == "whole answer"
    assert content_text(b'{"choices":[{"text":"legacy"}]}') == "legacy"
    tool = b'{"choices":[{"delta":{"tool_calls":[{"function":{"arguments":"{\\"a\\""}}]}}]}'
    assert content_text(tool) == '{"a"'
    assert content_text(b"not json") == ""
