"""SSE pass-through: whole events forwarded unchanged, the usage chunk found and kept or dropped."""

from __future__ import annotations

import itertools

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.upstream.sse import ChoicesForwarder, SSEForwarder


def event(payload: dict[str, object]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


ROLE = event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
TOKENS = [event({"choices": [{"index": 0, "delta": {"content": f" w{i}"}}]}) for i in range(5)]
USAGE = event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}})
DONE = b"data: [DONE]\n\n"
STREAM = ROLE + b"".join(TOKENS) + USAGE + DONE


def feed_all(forwarder: SSEForwarder, reads: list[bytes]) -> tuple[bytes, int]:
    out, tokens = b"", 0
    for read in reads:
        chunk, count = forwarder.feed(read)
        out += chunk
        tokens += count
    return out + forwarder.finish(), tokens


def test_whole_events_pass_as_the_same_bytes_object() -> None:
    forwarder = SSEForwarder(keep_usage=True)
    for piece in (ROLE, TOKENS[0], TOKENS[1]):
        out, _ = forwarder.feed(piece)
        assert out is piece


@pytest.mark.parametrize("size", [1, 3, 17, 64, len(STREAM)])
def test_any_read_boundaries_give_the_same_stream(size: int) -> None:
    reads = [STREAM[i : i + size] for i in range(0, len(STREAM), size)]
    forwarder = SSEForwarder(keep_usage=True)
    out, tokens = feed_all(forwarder, reads)
    assert out == STREAM
    assert tokens == 5
    assert forwarder.usage == {"prompt_tokens": 7, "completion_tokens": 5}


def test_usage_chunk_is_dropped_when_the_client_did_not_ask() -> None:
    forwarder = SSEForwarder(keep_usage=False)
    out, tokens = feed_all(forwarder, [STREAM[:100], STREAM[100:]])
    assert out == ROLE + b"".join(TOKENS) + DONE
    assert tokens == 5
    assert forwarder.usage == {"prompt_tokens": 7, "completion_tokens": 5}


@pytest.mark.parametrize("keep_usage", [True, False])
def test_a_read_holding_the_whole_stream_changes_only_the_usage_event(keep_usage: bool) -> None:
    # An unpaced backend's stream in one read: its comments and blank events pass as they came.
    first, rest = b"".join(TOKENS[:2]), b"".join(TOKENS[2:])
    stream = ROLE + b": ping\n\n" + first + b"\n\n" + rest + USAGE + b"\n\n"
    forwarder = SSEForwarder(keep_usage=keep_usage)
    out, count = forwarder.feed(stream + DONE)
    assert out == (stream if keep_usage else stream.replace(USAGE, b""))
    assert count == 5
    assert forwarder.finish() == DONE
    assert forwarder.usage == {"prompt_tokens": 7, "completion_tokens": 5}


def test_usage_on_a_content_chunk_is_nulled_not_dropped() -> None:
    last = event({"choices": [{"delta": {"content": " end"}}], "usage": {"prompt_tokens": 1}})
    forwarder = SSEForwarder(keep_usage=False)
    out, tokens = feed_all(forwarder, [TOKENS[0] + last + DONE])
    assert out.count(b"data:") == 3
    assert b'"usage":null' in out
    assert tokens == 2
    assert forwarder.usage == {"prompt_tokens": 1}


@pytest.mark.parametrize(
    "text",
    [b"\\ud83d", b"\xf0\x9f"],  # a lone surrogate's escape; half a character's bytes
)
def test_a_content_chunk_with_usage_that_orjson_refuses_is_relayed_not_dropped(
    text: bytes,
) -> None:
    """Such a chunk (vLLM's continuous usage puts usage on every one) was dropped whole for a
    client that had not asked for usage: its text never reached it, though clients read it
    (JavaScript joins two surrogate halves into the emoji)."""
    usage = b',"usage":{"prompt_tokens":3,"completion_tokens":2}'
    chunk = b'data: {"choices":[{"index":0,"delta":{"content":"' + text + b'"}}]' + usage + b"}\n\n"
    forwarder = SSEForwarder(keep_usage=False)
    out, tokens = feed_all(forwarder, [TOKENS[0] + chunk + DONE])
    assert out == TOKENS[0] + chunk + DONE
    assert tokens == 2
    if text.isascii():  # readable as clients read it: its usage is the bill's
        assert forwarder.usage == {"prompt_tokens": 3, "completion_tokens": 2}


def test_crlf_events_are_cut_at_crlf_boundaries() -> None:
    crlf = STREAM.replace(b"\n\n", b"\r\n\r\n")
    forwarder = SSEForwarder(keep_usage=False)
    out, _ = forwarder.feed(crlf[:50])
    assert out == b""
    out2, _ = forwarder.feed(crlf[50:])
    assert out2.endswith(b'w4"}}]}\r\n\r\n')
    assert b"prompt_tokens" not in out2
    assert forwarder.finish() == b"data: [DONE]\r\n\r\n"
    assert forwarder.usage is not None


def test_role_only_chunk_is_not_a_token() -> None:
    forwarder = SSEForwarder(keep_usage=True)
    assert forwarder.feed(ROLE) == (ROLE, 0)
    assert forwarder.feed(TOKENS[0]) == (TOKENS[0], 1)
    assert forwarder.feed(DONE) == (b"", 0)


def test_done_is_held_for_the_end_of_the_response() -> None:
    # The pipeline settles the request before the last message; [DONE] must be in it.
    forwarder = SSEForwarder(keep_usage=True)
    assert forwarder.feed(TOKENS[0] + TOKENS[1] + DONE) == (TOKENS[0] + TOKENS[1], 2)
    assert forwarder.finish() == DONE


def test_unterminated_tail_is_forwarded_at_the_end() -> None:
    forwarder = SSEForwarder(keep_usage=True)
    out, _ = forwarder.feed(TOKENS[0] + b"data: {partial")
    assert out == TOKENS[0]
    assert forwarder.finish() == b"data: {partial"


@st.composite
def streams(draw: st.DrawFn) -> tuple[list[bytes], int, bytes]:
    """A backend's stream as events (comments and usage among them), the token events a client
    is sent, and the usage event's payload shape."""
    texts = draw(st.lists(st.sampled_from([" w", ' "q"', "\\", "é", "\n", "data: x"]), max_size=12))
    events = [ROLE]
    if draw(st.booleans()):
        events.append(b": ping\n\n")
    for text in texts:  # some events' JSON over two data: lines (the spec joins them)
        one = event({"choices": [{"index": 0, "delta": {"content": text}}]})
        events.append(
            one.replace(b'"choices":', b'"choices":\ndata: ') if draw(st.booleans()) else one
        )
    events.append(event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
    tokens = len(texts) + 1 if texts else 0  # from the first text on, the finish chunk too
    usage = draw(st.sampled_from(["alone", "on the finish chunk", "none"]))
    if usage == "alone":
        events.append(USAGE)
    elif usage == "on the finish chunk":
        finish = {"index": 0, "delta": {}, "finish_reason": "stop"}
        events[-1] = event({"choices": [finish], "usage": {"prompt_tokens": 7}})
    # Each event's lines end in LF or CRLF: a backend may change from one to the other.
    events = [e.replace(b"\n", b"\r\n") if draw(st.booleans()) else e for e in [*events, DONE]]
    return events, tokens, usage.encode()


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(
    stream=streams(),
    cuts=st.lists(st.integers(0, 2000), max_size=10),
    crlf=st.booleans(),
    keep_usage=st.booleans(),
)
def test_any_stream_cut_anywhere_is_forwarded_counted_and_billed_as_in_one_read(
    stream: tuple[list[bytes], int, bytes], cuts: list[int], crlf: bool, keep_usage: bool
) -> None:
    events, tokens, usage = stream
    if crlf:
        events = [e.replace(b"\r\n", b"\n").replace(b"\n", b"\r\n") for e in events]
    whole = b"".join(events)
    bounds = [0, *sorted({cut % (len(whole) + 1) for cut in cuts}), len(whole)]
    reads = [whole[a:b] for a, b in itertools.pairwise(bounds) if b > a]
    forwarder = SSEForwarder(keep_usage=keep_usage)
    out, counted = feed_all(forwarder, reads)
    expected = (
        whole
        if keep_usage or usage == b"none"
        else whole.replace(events[-2], b"")  # the usage-only chunk dropped
        if usage == b"alone"
        else whole.replace(b'"usage":{"prompt_tokens":7}', b'"usage":null')
    )
    assert out == expected
    assert counted == tokens
    assert forwarder.usage == (
        None if usage == b"none" else {"prompt_tokens": 7, "completion_tokens": 5}
        if usage == b"alone" else {"prompt_tokens": 7}
    )  # fmt: skip


@settings(max_examples=200, derandomize=True, database=None, deadline=None)
@given(
    after=st.integers(0, 3),
    unended=st.booleans(),
    crlf=st.booleans(),
    cuts=st.lists(st.integers(0, 2000), max_size=12),
)
def test_a_stream_that_goes_on_after_done_is_forwarded_and_counted_as_in_one_read(
    after: int, unended: bool, crlf: bool, cuts: list[int]
) -> None:
    """A backend that sends events after [DONE] (or ends in the middle of one): however its
    writes cut the stream, the client gets every byte in order and the count is the same as
    from one read ([DONE] is held back only while it is the last thing sent)."""
    events = [ROLE, *TOKENS, DONE, *TOKENS[:after]]
    whole = b"".join(events) + (b'data: {"choices": [' if unended else b"")
    if crlf:
        whole = whole.replace(b"\n\n", b"\r\n\r\n")
    bounds = [0, *sorted({cut % (len(whole) + 1) for cut in cuts}), len(whole)]
    reads = [whole[a:b] for a, b in itertools.pairwise(bounds) if b > a]
    out, counted = feed_all(SSEForwarder(keep_usage=True), reads)
    assert out == whole
    assert counted == feed_all(SSEForwarder(keep_usage=True), [whole])[1]


@pytest.mark.parametrize("name", ["reasoning", "reasoning_content"])
def test_reasoning_under_either_name_counts_from_its_first_text(name: str) -> None:
    """vLLM (0.11 on), OpenRouter and Ollama send `reasoning`; llama.cpp `reasoning_content`."""
    thinking = [event({"choices": [{"index": 0, "delta": {name: f"t{i}"}}]}) for i in range(3)]
    stream = ROLE + b"".join(thinking) + TOKENS[0] + TOKENS[1]
    assert feed_all(SSEForwarder(keep_usage=True), [stream])[1] == 5
    assert feed_all(SSEForwarder(keep_usage=True), [ROLE, *thinking, TOKENS[0]])[1] == 4


FINISH = event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})


VERDICT = {"content_filter_results": {"hate": {"filtered": False}}}
FILTER = event({"choices": [{"index": 0, "finish_reason": None, **VERDICT}]})
EMPTY = event({"choices": []})
ROLE_ONLY = event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
CALL = event({"choices": [{"index": 0, "delta": {"tool_calls": [
    {"index": 0, "function": {"arguments": '{"city'}}]}}]})  # fmt: skip
OTHER = event({"id": "x", "choices": [{"index": 1, "delta": {"content": "other"}}]})


@pytest.mark.parametrize(
    ("read", "texted", "counted"),
    [
        (TOKENS[1], True, 1),  # the usual read: found where the last text began
        (FINISH, False, 1),  # counted for the bill as before, timed no more
        (FILTER, False, 1),
        (EMPTY, False, 1),
        (ROLE_ONLY, False, 1),
        (ROLE, False, 1),  # empty content
        (USAGE, False, 0),
        (b": keep-alive\n\n", False, 0),
        (FINISH + TOKENS[1], True, 2),  # text after a textless event in one read
        (TOKENS[1] + FINISH, True, 2),
        (CALL, True, 1),  # another shape: searched
        (OTHER, True, 1),
    ],
)
def test_after_the_first_token_a_read_says_whether_it_holds_text(
    read: bytes, texted: bool, counted: int
) -> None:
    """Every data event after the first token counts toward the bill's estimate (but usage
    alone); only those with text are timed (`texted`), however the read before was shaped."""
    for before in (TOKENS[0], FINISH, OTHER):
        forwarder = SSEForwarder(keep_usage=True)
        assert forwarder.feed(ROLE + TOKENS[0]) == (ROLE + TOKENS[0], 1)
        assert forwarder.texted
        forwarder.feed(before)
        assert forwarder.feed(read) == (read, counted)
        assert forwarder.texted is texted, (before, read)
        assert forwarder.feed(TOKENS[2]) == (TOKENS[2], 1)
        assert forwarder.texted


def test_before_the_first_token_a_read_without_text_is_not_texted() -> None:
    forwarder = SSEForwarder(keep_usage=True)
    assert forwarder.feed(ROLE) == (ROLE, 0)
    assert not forwarder.texted
    assert forwarder.feed(TOKENS[0]) == (TOKENS[0], 1)
    assert forwarder.texted


def test_a_tool_calls_name_and_a_refusal_are_text_but_not_yet_tokens() -> None:
    """The name event (arguments "") is the first text (TTFT) but, as before, no token event
    for the bill's estimate, which counts from the first argument piece; a refusal is text."""
    call = {"index": 0, "id": "call_1", "function": {"name": "weather", "arguments": ""}}
    named = event({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]})
    forwarder = SSEForwarder(keep_usage=True)
    assert forwarder.feed(ROLE) == (ROLE, 0)
    assert not forwarder.texted
    assert forwarder.feed(named) == (named, 0)
    assert forwarder.texted
    assert forwarder.feed(CALL) == (CALL, 1)
    assert forwarder.texted
    assert forwarder.feed(named) == (named, 1)  # a second call's name: counted as every event
    assert forwarder.texted
    refusal = event({"choices": [{"index": 0, "delta": {"refusal": "I can't"}}]})
    fresh = SSEForwarder(keep_usage=True)
    assert fresh.feed(refusal) == (refusal, 0)
    assert fresh.texted


def test_a_completions_choice_counts_once_whatever_its_logprobs_name() -> None:
    """Choices side by side count one token event each, in any read; a completion's
    `top_logprobs` may have a token named "text" as a key, which is no choice."""
    logprobs = {"tokens": [" w"], "top_logprobs": [{"text": -0.5, " w": -0.1}]}
    one = {"text": " w", "logprobs": logprobs, "finish_reason": None}
    choices = [{"index": i, **one} for i in range(2)]
    stream = event({"choices": choices}) * 3 + event({"choices": choices[:1]})
    for size in (1, 7, len(stream)):
        forwarder = ChoicesForwarder(keep_usage=True, completions=True)
        reads = [stream[i : i + size] for i in range(0, len(stream), size)]
        assert feed_all(forwarder, reads)[1] == 7


def test_a_comment_that_mentions_usage_takes_no_token_off_the_count() -> None:
    """A comment is no data event: counted as the usage chunk, it took a token off the bill."""
    sse = SSEForwarder(keep_usage=True)
    token = b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'
    out, events = sse.feed(token)
    assert events == 1
    comment = b': "prompt_tokens" is coming\n\n'
    out, events = sse.feed(token + comment + token)
    assert out == token + comment + token
    assert events == 2
