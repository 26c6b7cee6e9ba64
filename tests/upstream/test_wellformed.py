"""Which backend 200s pass as answers: whole answers by operation, streams by their first event."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.context import Operation
from proxy.upstream.wellformed import FirstEvent, MalformedAnswer, whole_answer


@pytest.mark.parametrize(
    ("operation", "raw"),
    [
        ("chat", b'{"choices": [], "extra": {"anything": 1}}'),
        ("text_completion", b'{"choices": [{"text": "x"}]}'),
        ("embeddings", b'{"data": [], "object": "list"}'),
    ],
)
def test_answers_of_the_right_shape_pass_with_extra_fields(
    operation: Operation, raw: bytes
) -> None:
    assert whole_answer(operation, raw) == orjson.loads(raw)


@pytest.mark.parametrize(
    ("operation", "raw", "problem"),
    [
        ("chat", b"<html>hi</html>", "not JSON"),
        ("chat", b"[]", "not an object"),
        ("chat", b'{"hello": 1}', "no 'choices' list"),
        ("chat", b'{"choices": null}', "no 'choices' list"),
        ("text_completion", b'{"choices": "abc"}', "no 'choices' list"),
        ("embeddings", b'{"choices": []}', "no 'data' list"),
        ("chat", b"", "not JSON"),
    ],
)
def test_other_answers_say_what_is_wrong(operation: Operation, raw: bytes, problem: str) -> None:
    with pytest.raises(MalformedAnswer) as said:
        whole_answer(operation, raw)
    assert problem in str(said.value)


def judge(*reads: bytes, end: bool = False) -> FirstEvent:
    check = FirstEvent(limit_bytes=1000)
    for read in reads:
        if check.feed(read):
            return check
    if end:
        check.end()
    return check


def test_a_first_event_split_across_reads_is_judged_when_whole() -> None:
    check = FirstEvent()
    assert not check.feed(b": comment\r\n\r\nda")
    assert not check.feed(b'ta: {"choices": []}\r')
    assert check.feed(b"\n\r\n")
    assert check.problem is None


@pytest.mark.parametrize(
    ("reads", "problem"),
    [
        ((b"data: <html>\n\n",), "not JSON"),
        ((b"data: [1, 2]\n\n",), "not a JSON object"),
        ((b"data: [DONE]\n\n",), "not JSON"),
        ((b": ping\n\n" * 200,), "no data event in its first 1000 bytes"),
        ((b'event: x\ndata: {"a"\ndata: : 1}\n\n',), None),  # data lines join
        ((b'data: {"error": {"message": "x"}}\n\n',), None),  # an error event is the client's
    ],
)
def test_first_events(reads: tuple[bytes, ...], problem: str | None) -> None:
    check = judge(*reads)
    assert check.decided
    if problem is None:
        assert check.problem is None
    else:
        assert check.problem is not None
        assert problem in check.problem


def test_a_stream_that_ends_before_a_data_event_is_malformed() -> None:
    check = judge(b": only a comment\n\n", end=True)
    assert check.problem == "it ended without a data event"


_STARTS = [
    b": ping\n\n: ping\n\n" + b'data: {"choices": []}\n\n',
    b": ping\r\n\r\n" + b'event: x\r\ndata: {"a"\r\ndata: : 1}\r\n\r\ndata: x\r\n\r\n',
    b"event: ping\n\n" + b"data: <html>" + b"y" * 300 + b"</html>\n\n",
    b": ping\n\n" * 200,  # no data event in the first 1000 bytes, whatever the reads
    b"\n\n\n\n" + b"data: [1]\r\n\r\n",
    b'data: {"partial": "never ends',
]


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(start=st.sampled_from(_STARTS), data=st.data())
def test_a_first_event_is_judged_alike_however_its_reads_cut_it(
    start: bytes, data: st.DataObject
) -> None:
    """Cut anywhere, in any number of reads (one byte each included), a stream's start is
    judged as when it comes in one read, with the same problem."""
    cuts = sorted(data.draw(st.sets(st.integers(1, len(start) - 1), max_size=len(start))))
    reads = [start[a:b] for a, b in zip([0, *cuts], [*cuts, len(start)], strict=True)]
    whole = judge(start, end=True)
    check = FirstEvent(limit_bytes=1000)
    for read in reads:
        if check.feed(read):
            break
    else:
        check.end()
    assert (check.decided, check.problem) == (whole.decided, whole.problem)


def test_an_answer_orjson_refuses_is_read_as_clients_read_it_up_to_a_mebibyte() -> None:
    """NaN, a number past a double, lone surrogates (U+FFFD to the counters): read as Python's
    reader (the openai SDK's) reads them; past 1 MiB not at all, as Python's reader holds the
    event loop (150 ms for 5 MB)."""
    raw = b'{"choices": [{"message": {"content": "a\\ud800"}}], "\\udc00": [NaN, 1e400]}'
    parsed = whole_answer("chat", raw)
    assert parsed["choices"][0]["message"]["content"] == "a\ufffd"
    assert "\ufffd" in parsed
    padding = b'"' + b"x" * (1 << 20) + b'"'
    with pytest.raises(MalformedAnswer, match="past 1 MiB"):
        whole_answer("chat", b'{"choices": [], "pad": ' + padding + b', "n": NaN}')
