"""The fold's bulk paths against its own one-event-at-a-time parse, on generated streams.

`StreamFold` takes most events without parsing them (a learnt template, reads cut apart in
bulk, batches halved and their ends cut off); its promise is the answer a parse of every chunk
gives, byte for byte, refused where that one is. Here any mix of chunks a backend may send,
with LF or CRLF line ends, in any reads and batch sizes, is folded both ways and compared, and
a plain stream's text is checked against what was sent.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

import proxy.cache.fold as fold_module
from proxy.cache.answer import Answer
from proxy.cache.fold import StreamFold

USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m"}
# Text that needs escapes, is not ASCII, or looks like the SSE framing itself.
PIECES = st.lists(
    st.sampled_from(['a', ' ', '"', '\\', '\n', '\r', 'é', '中', '🙂', '\x00', '\u2028',
                     'data: ', '[DONE]', '{', '}', ':']),
    max_size=4,
).map("".join)  # fmt: skip


def chunk(choice: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {**HEAD, "system_fingerprint": "fp", "choices": [choice], **more}


def text(piece: str, name: str = "content") -> dict[str, Any]:
    return chunk({"index": 0, "delta": {name: piece}, "logprobs": None, "finish_reason": None})


@st.composite
def middle_event(draw: st.DrawFn) -> tuple[bytes, str | None]:
    """A chunk between the first and the finish, and the content it adds (None: a hostile
    chunk, whose content only the parse decides)."""
    piece = draw(PIECES)
    kind = draw(st.sampled_from(["text"] * 6 + ["padded", "created", "reasoning", "role"] * 2
                                + ["duplicate", "smuggled"]))  # fmt: skip
    if kind == "text":
        return orjson.dumps(text(piece)), piece
    if kind == "padded":  # OpenAI's obfuscation: new padding every chunk
        return orjson.dumps({**text(piece), "obfuscation": draw(st.text("xyz", max_size=4))}), piece
    if kind == "created":  # a field that changes: off the template, parsed
        return orjson.dumps({**text(piece), "created": draw(st.integers(0, 99))}), piece
    if kind == "reasoning":
        return orjson.dumps(text(piece, "reasoning_content")), ""
    if kind == "role":
        role = {"index": 0, "delta": {"role": "assistant", "content": piece}, "finish_reason": None}
        return orjson.dumps(chunk(role)), piece
    if kind == "duplicate":  # the same key twice in the text's delta: the parse keeps the last
        raw = orjson.dumps(text("a"))
        return raw.replace(b'"content":"a"', b'"content":"a","content":"evil"'), None
    # Another `choices` after the padding, where a bulk cut would take the text before it.
    raw = orjson.dumps({**text("a"), "obfuscation": "x"})
    smuggled = b'"obfuscation":"x","choices":[{"index":0,"delta":{"content":"evil"}}],"z":"q"'
    return raw.replace(b'"obfuscation":"x"', smuggled), None


def framed(payloads: list[bytes], sep: bytes) -> list[bytes]:
    line_end = sep[: len(sep) // 2]
    return [b"data: " + payload + line_end + line_end for payload in payloads]


def folded(events: list[bytes], cuts: list[int], batch_bytes: int) -> Answer | None:
    """The events fed in reads ending at `cuts` (whole events), folded in batches."""
    fold = StreamFold(1 << 30)
    with mock.patch.object(fold_module, "_BATCH_BYTES", batch_bytes):
        start = 0
        for end in [*sorted(set(cuts)), len(events)]:
            if end > start:
                fold.feed(b"".join(events[start:end]))
                start = end
        return fold.answer("chat", USAGE)


def parsed_one_by_one(events: list[bytes]) -> Answer | None:
    """The reference: no template is ever learnt, so every event is parsed on its own."""
    with mock.patch.object(fold_module, "_MAX_TEMPLATES", 0):
        return folded(events, list(range(len(events))), 1)


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(
    middle=st.lists(middle_event(), max_size=40),
    sep=st.sampled_from([b"\n\n", b"\r\n\r\n"]),
    usage_chunk=st.booleans(),
    cuts=st.lists(st.integers(0, 45), max_size=12),
    batch_bytes=st.sampled_from([1, 200, fold_module._BATCH_BYTES]),
)
def test_any_stream_folds_to_what_parsing_every_chunk_gives(
    middle: list[tuple[bytes, str | None]],
    sep: bytes,
    usage_chunk: bool,
    cuts: list[int],
    batch_bytes: int,
) -> None:
    finish = chunk({"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"})
    ending = [orjson.dumps(finish)]
    if usage_chunk:
        ending.append(orjson.dumps({**HEAD, "choices": [], "usage": USAGE}))
    payloads = [orjson.dumps(text("Hi")), *(raw for raw, _ in middle), *ending, b"[DONE]"]
    events = framed(payloads, sep)
    answer = folded(events, cuts, batch_bytes)
    assert answer == parsed_one_by_one(events)
    assert answer is not None
    assert answer.message is not None
    sent = [piece for _, piece in middle if piece is not None]
    if len(sent) == len(middle):  # no hostile chunk: the text is what was sent
        assert answer.message["content"] == "Hi" + "".join(sent)


@settings(max_examples=150, derandomize=True, database=None, deadline=None)
@given(
    pieces=st.lists(PIECES, max_size=30),
    bad=st.sampled_from([
        b'{"error": {"message": "overloaded"}}',
        orjson.dumps(chunk({"index": 1, "delta": {"content": "x"}})),
        orjson.dumps({**HEAD, "choices": [{"delta": {"content": "a"}}, {"delta": {}}]}),
        b"not json",
        b"[1, 2]",
    ]),
    where=st.integers(0, 30),
    sep=st.sampled_from([b"\n\n", b"\r\n\r\n"]),
    cuts=st.lists(st.integers(0, 35), max_size=8),
    batch_bytes=st.sampled_from([1, 200, fold_module._BATCH_BYTES]),
)  # fmt: skip
def test_a_stream_with_a_chunk_the_parse_refuses_is_refused_however_it_is_read(
    pieces: list[str], bad: bytes, where: int, sep: bytes, cuts: list[int], batch_bytes: int
) -> None:
    payloads = [orjson.dumps(text("Hi")), *(orjson.dumps(text(p)) for p in pieces)]
    payloads.insert(1 + min(where, len(pieces)), bad)
    finish = chunk({"index": 0, "delta": {}, "finish_reason": "stop"})
    events = framed([*payloads, orjson.dumps(finish), b"[DONE]"], sep)
    assert parsed_one_by_one(events) is None
    assert folded(events, cuts, batch_bytes) is None
