"""The named-event pass-through: bytes unchanged, text deltas counted, usage read, the last
event held back until the end, however the backend's writes cut the events."""

from __future__ import annotations

import re

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.apis import AGENT_APIS, EventForwarder
from proxy.stages.usage import checked_usage


def event(data: dict[str, object], sep: bytes = b"\n") -> bytes:
    kind = str(data["type"]).encode()
    return b"event: " + kind + sep + b"data: " + orjson.dumps(data) + sep + sep


def messages_stream(sep: bytes = b"\n") -> bytes:
    usage_start = {"input_tokens": 11, "output_tokens": 1, "cache_read_input_tokens": 4}
    parts: list[dict[str, object]] = [
        {"type": "message_start", "message": {"type": "message", "usage": usage_start}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text"}},
        {"type": "ping"},
        *[
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": t}}
            for t in ("Hel", "lo", ' "type":"content_block_delta"')
        ],
        {"type": "content_block_stop", "index": 0},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn"},
            "usage": {"output_tokens": 3},
        },
        {"type": "message_stop"},
    ]
    return b"".join(event(p, sep) for p in parts)


@pytest.mark.parametrize("sep", [b"\n", b"\r\n"])
@pytest.mark.parametrize("size", [1, 7, 64, 100_000])
def test_a_messages_stream_passes_through_whole_however_it_is_cut(sep: bytes, size: int) -> None:
    raw = messages_stream(sep)
    forwarder = EventForwarder(AGENT_APIS["messages"].events)
    out: list[bytes] = []
    deltas = 0
    for start in range(0, len(raw), size):
        written, tokens = forwarder.feed(raw[start : start + size])
        out.append(written)
        deltas += tokens
        assert b"message_stop" not in written  # held back for the end
    ending = forwarder.finish()
    assert ending == event({"type": "message_stop"}, sep)
    assert b"".join(out) + ending == raw
    assert deltas == 3  # a delta whose text quotes an event type is still one
    assert forwarder.usage is not None
    usage = AGENT_APIS["messages"].usage(forwarder.usage)
    assert checked_usage(usage) == (11 + 4, 3)  # prompt-cache reads are input too


def test_a_messages_stream_cut_before_message_delta_has_no_usage() -> None:
    raw = messages_stream()
    cut = raw.index(b"event: message_delta")
    forwarder = EventForwarder(AGENT_APIS["messages"].events)
    forwarder.feed(raw[:cut])
    assert forwarder.usage is None  # message_start's output count is not the answer's


def test_a_responses_stream_bills_from_response_completed() -> None:
    usage = {"input_tokens": 9, "output_tokens": 2, "total_tokens": 11}
    parts: list[dict[str, object]] = [
        {"type": "response.created", "response": {"usage": None}, "sequence_number": 0},
        {"type": "response.output_text.delta", "delta": "Hi", "sequence_number": 1},
        {"type": "response.output_text.delta", "delta": " you", "sequence_number": 2},
        {"type": "response.output_text.done", "text": "Hi you", "sequence_number": 3},
        {"type": "response.completed", "response": {"usage": usage}, "sequence_number": 4},
    ]
    raw = b"".join(event(p) for p in parts)
    forwarder = EventForwarder(AGENT_APIS["responses"].events)
    written, deltas = forwarder.feed(raw)
    assert deltas == 2
    assert written + forwarder.finish() == raw
    assert forwarder.usage == usage
    assert checked_usage(AGENT_APIS["responses"].usage(usage)) == (9, 2)


@pytest.mark.parametrize(
    "usage",
    [
        {"input_tokens": -1, "output_tokens": 3},
        {"input_tokens": 5, "output_tokens": 3, "cache_read_input_tokens": -4},
        {"input_tokens": 5, "output_tokens": 3, "cache_creation_input_tokens": 2.5},
        {"input_tokens": True, "output_tokens": 3},
    ],
)
def test_unbelievable_messages_usage_stays_unbelieved(usage: dict[str, object]) -> None:
    assert checked_usage(AGENT_APIS["messages"].usage(usage)) is None


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_events_after_the_ending_one_go_out_as_they_come(api: str) -> None:
    """A backend that goes on after its ending event (message_stop, response.completed): the
    ending is held back once, then goes out with the next read, and every later event as it
    comes. (They were held to the end and the whole held part scanned again on each read: a
    backend could keep a gateway's core busy and its memory growing for one request.)"""
    ending = (
        {"type": "message_stop"}
        if api == "messages"
        else {"type": "response.completed", "response": {"usage": None}, "sequence_number": 9}
    )
    delta = (
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "x"}}
        if api == "messages"
        else {"type": "response.output_text.delta", "delta": "x", "sequence_number": 10}
    )
    forwarder = EventForwarder(AGENT_APIS[api].events)
    assert forwarder.feed(event(ending)) == (b"", 0)  # held back
    written, deltas = forwarder.feed(event(delta))
    assert (written, deltas) == (event(ending) + event(delta), 1)
    for _ in range(5000):
        assert forwarder.feed(event(delta)) == (event(delta), 1)
    assert forwarder.finish() == b""


@pytest.mark.parametrize("first", [b"\n", b"\r\n"])
@pytest.mark.parametrize("size", [1, 7, 100_000])
def test_a_stream_whose_line_ends_change_is_cut_counted_and_billed_as_it_comes(
    first: bytes, size: int
) -> None:
    """The spec lets a stream end lines in LF or CRLF, in any mix: a backend that changes from
    one to the other mid-stream has each event go out when it ends, counted, its usage read."""
    lf, crlf = _events_of(messages_stream(b"\n")), _events_of(messages_stream(b"\r\n"))
    # Events alternate: the first in `first`'s line ends, the next in the other's, and so on.
    mixed = b"".join((lf if (i % 2 == 0) == (first == b"\n") else crlf)[i] for i in range(len(lf)))
    forwarder = EventForwarder(AGENT_APIS["messages"].events)
    out, deltas = b"", 0
    for start in range(0, len(mixed), size):
        written, tokens = forwarder.feed(mixed[start : start + size])
        out, deltas = out + written, deltas + tokens
        if start + size >= mixed.index(b"message_delta") + 200:
            assert b"message_delta" in out  # gone out when it ended, not held to the end
    assert out + forwarder.finish() == mixed
    assert deltas == 3
    assert forwarder.usage is not None
    assert checked_usage(AGENT_APIS["messages"].usage(forwarder.usage)) == (11 + 4, 3)


def _events_of(stream: bytes) -> list[bytes]:
    return re.split(rb"(?<=\n)(?=event:)", stream)


def _stream(api: str, sep: bytes, after: int) -> bytes:
    """A Messages or Responses stream with `after` events past its ending one."""
    if api == "messages":
        raw = messages_stream(sep)
        extra = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta"}}
    else:
        usage = {"input_tokens": 9, "output_tokens": 2, "total_tokens": 11}
        parts: list[dict[str, object]] = [
            {"type": "response.created", "response": {"usage": None}},
            {"type": "response.output_text.delta", "delta": "Hi"},
            {"type": "response.output_text.delta", "delta": " you"},
            {"type": "response.completed", "response": {"usage": usage}},
        ]
        raw = b"".join(event(p, sep) for p in parts)
        extra = {"type": "response.output_text.delta", "delta": "x"}
    return raw + event(extra, sep) * after


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(
    api=st.sampled_from(["messages", "responses"]),
    sep=st.sampled_from([b"\n", b"\r\n"]),
    after=st.integers(0, 3),
    data=st.data(),
)
def test_a_named_event_stream_cut_anywhere_goes_out_as_in_one_read(
    api: str, sep: bytes, after: int, data: st.DataObject
) -> None:
    """However a backend's writes cut the stream (one byte a read included), the client gets
    the same bytes, the same count of text events and the same usage as from one read."""
    raw = _stream(api, sep, after)
    cuts = sorted(data.draw(st.sets(st.integers(1, len(raw) - 1), max_size=60)))
    reads = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]

    def forwarded(pieces: list[bytes]) -> tuple[bytes, int, object]:
        forwarder = EventForwarder(AGENT_APIS[api].events)
        out, deltas = b"", 0
        for piece in pieces:
            written, tokens = forwarder.feed(piece)
            out, deltas = out + written, deltas + tokens
        return out + forwarder.finish(), deltas, forwarder.usage

    assert forwarded(reads) == forwarded([raw])
    assert forwarded(reads)[0] == raw


_TOOLS = [{"type": "function", "name": "weather"}]
_CALL = {"type": "function_call", "id": "fc_1", "call_id": "c", "name": "weather", "arguments": ""}
_MCP_TOOLS = {"type": "mcp_list_tools", "server_label": "dice", "tools": [{"name": "roll"}]}


@pytest.mark.parametrize(
    ("api", "data", "texted"),
    [
        ("responses", {"type": "response.output_item.added", "item": _CALL}, True),
        ("responses", {"type": "response.created", "response": {"tools": _TOOLS}}, False),
        ("responses", {"type": "response.output_item.added", "item": _MCP_TOOLS}, False),
        ("responses", {"type": "response.output_item.done", "item": _CALL}, False),
        ("messages", {"type": "content_block_start", "index": 1, "content_block": {
            "type": "tool_use", "id": "toolu_1", "name": "weather", "input": {}}}, True),
        ("messages", {"type": "content_block_start", "index": 0, "content_block": {
            "type": "text", "text": ""}}, False),
    ],
)  # fmt: skip
def test_the_event_that_opens_a_tool_call_by_name_is_timed_as_text(
    api: str, data: dict[str, object], texted: bool
) -> None:
    """As a chat tool call's name ends TTFT, so does the event opening an agent API's call
    (no token of the count); an event that names tools but opens no call does not."""
    forwarder = EventForwarder(AGENT_APIS[api].events)
    assert forwarder.feed(event(data)) == (event(data), 0)
    assert forwarder.texted is texted


@pytest.mark.parametrize("size", [1, 7, 100_000])
def test_a_held_usage_event_is_not_lost_when_another_is_held_after_it(size: int) -> None:
    """Each event that completes a usage is held to be shown as billed: a second one in a later
    read took the first one's place, and the first never reached the client."""
    raw = messages_stream()
    second = event({"type": "message_delta", "delta": {}, "usage": {"output_tokens": 4}})
    at = raw.index(b"event: message_stop")
    raw = raw[:at] + second + raw[at:]
    forwarder = EventForwarder(AGENT_APIS["messages"].events, lambda usage: False)
    out = b"".join(forwarder.feed(raw[at : at + size])[0] for at in range(0, len(raw), size))
    held = forwarder.held
    assert held == second
    assert out + forwarder.finish() == raw
