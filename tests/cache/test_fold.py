"""A stream's answer folded chunk by chunk: exact for any text, constant work per chunk."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

import proxy.cache.fold as fold_module
import proxy.cache.template as template_module
from proxy.cache.answer import Answer
from proxy.cache.fold import StreamFold, from_stream
from proxy.cache.replay import replay_response, replay_stream

USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m"}
# Pieces a model really sends: plain words, and ones that need escapes or are not ASCII.
PIECES = [" word", ' "quoted"', "\n", " back\\slash", " café", " 中文", "\t", " 🙂", "", " end"]


def event(choice: dict[str, Any], **more: Any) -> bytes:
    chunk = {**HEAD, "system_fingerprint": "fp", "choices": [choice], **more}
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def text_event(piece: str, name: str = "content") -> bytes:
    return event({"index": 0, "delta": {name: piece}, "logprobs": None, "finish_reason": None})


def finish_event(reason: str = "stop") -> bytes:
    return event({"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason})


def calls(*deltas: dict[str, Any]) -> bytes:
    return event({"index": 0, "delta": {"tool_calls": list(deltas)}})


def role_event() -> bytes:
    return event({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})


def long_text(n: int) -> list[str]:
    return [PIECES[i % len(PIECES)] if i % 7 == 0 else f" w{i}" for i in range(n)]


def fold(events: list[bytes], *, per_read: int = 1, limit: int = 1 << 30) -> StreamFold:
    """The events fed as the relay would: `per_read` whole events per read."""
    folded = StreamFold(limit)
    for start in range(0, len(events), per_read):
        folded.feed(b"".join(events[start : start + per_read]))
    return folded


@pytest.fixture(autouse=True, params=[1, fold_module._BATCH_BYTES, 1 << 30])
def batch_bytes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Every test with each read folded as it comes, in batches as served, and all at once
    at the end: the answer does not depend on where the batches fall."""
    monkeypatch.setattr(fold_module, "_BATCH_BYTES", request.param)
    return int(request.param)


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every JSON parse the fold makes."""
    seen: list[bytes] = []

    def counted(raw: bytes) -> Any:
        seen.append(raw)
        return orjson.loads(raw)

    monkeypatch.setattr(fold_module, "_loads", counted)
    return seen


@pytest.mark.parametrize("per_read", [1, 3, 1 << 30])  # the last: the whole stream in one read
def test_a_long_stream_folds_into_exactly_its_text(per_read: int) -> None:
    pieces = long_text(5000)
    events = [role_event(), *map(text_event, pieces), finish_event(), b"data: [DONE]\n\n"]
    answer = fold(events, per_read=per_read).answer("chat", USAGE)
    assert answer == Answer(
        "chat", "m", "stop", USAGE, {"role": "assistant", "content": "".join(pieces)}, None, "fp"
    )
    # What a hit replays is built from the answer alone: the same answer, the same replay.
    streamed = from_stream("chat", replay_stream(answer, 9, include_usage=True), USAGE)
    assert streamed is not None
    assert streamed.message == answer.message
    whole = orjson.loads(replay_response(answer, 9))
    assert whole["choices"][0]["message"]["content"] == "".join(pieces)


def openai_event(piece: str, padding: str) -> bytes:
    """A chunk as OpenAI streams it: `obfuscation` pads every chunk with new random text."""
    choice = {"index": 0, "delta": {"content": piece}, "logprobs": None, "finish_reason": None}
    chunk = {**HEAD, "service_tier": "default", "system_fingerprint": "fp", "choices": [choice]}
    return b"data: " + orjson.dumps({**chunk, "obfuscation": padding}) + b"\n\n"


@pytest.mark.parametrize("per_read", [1, 4])
@pytest.mark.parametrize("padded", [False, True])
def test_parses_per_stream_do_not_grow_with_its_length(
    parses: list[bytes], per_read: int, padded: bool
) -> None:
    counts = []
    for n in (100, 5000):
        parses.clear()
        words = [f" w{i}" for i in range(n)]
        texts = [
            openai_event(w, "Qx7" * (i % 5)) if padded else text_event(w)
            for i, w in enumerate(words)
        ]
        events = [role_event(), *texts, finish_event(), b"data: [DONE]\n\n"]
        answer = fold(events, per_read=per_read).answer("chat", USAGE)
        assert answer is not None
        assert answer.message == {"role": "assistant", "content": "".join(words)}
        counts.append(len(parses))
    # The role chunk, the first text chunk, its template's probe, the finish chunk, the decode.
    assert counts == [5, 5]


@pytest.mark.parametrize("separator", [b"\n\n", b"\r\n\r\n"])
@pytest.mark.parametrize("escaped_every", [0, 50])
def test_a_read_of_many_events_is_cut_apart_in_a_few_calls(
    monkeypatch: pytest.MonkeyPatch, escaped_every: int, separator: bytes
) -> None:
    """A read holding a whole stream (a busy gateway reads many events at once) is taken in
    bulk: only the events off the template are looked at one by one, and the bulk calls grow
    with the log of the read's length, not with its length; with LF or CRLF line ends."""
    looked_at: list[bytes] = []
    bulk: list[int] = []
    payload, take = StreamFold._payload, template_module.Template.take

    def one(folded: StreamFold, line: bytes, data: bytes) -> None:
        looked_at.append(line)
        payload(folded, line, data)

    def many(template: Any, data: bytes) -> bool:
        bulk.append(len(data))
        return take(template, data)

    monkeypatch.setattr(StreamFold, "_payload", one)
    monkeypatch.setattr(template_module.Template, "take", many)
    for n in (256, 4096):
        looked_at.clear()
        bulk.clear()
        words = [' "q"' if escaped_every and i % escaped_every == 1 else f" w{i}" for i in range(n)]
        events = [role_event(), *map(text_event, words), finish_event(), DONE]
        events = [e.removesuffix(b"\n\n") + separator for e in events]
        answer = fold(events, per_read=len(events)).answer("chat", USAGE)
        assert answer is not None
        assert answer.message == {"role": "assistant", "content": "".join(words)}
        escaped = sum(1 for word in words if '"' in word)
        # The role chunk, the first text (its template), each escaped text, finish, [DONE].
        assert len(looked_at) == 4 + escaped
        assert len(bulk) <= 2 * (2 + escaped) * n.bit_length()


@pytest.mark.parametrize("separator", [b"\n\n", b"\r\n\r\n"])
def test_a_read_on_the_template_is_taken_whole_with_either_line_end(
    monkeypatch: pytest.MonkeyPatch, separator: bytes
) -> None:
    """Once the template is learnt, a read of events on it is cut apart in bulk whether the
    backend ends its lines with LF or CRLF: none of its events is looked at on its own."""
    monkeypatch.setattr(fold_module, "_BATCH_BYTES", 1)  # each read folded as it comes
    looked_at: list[bytes] = []
    payload = StreamFold._payload

    def one(folded: StreamFold, line: bytes, data: bytes) -> None:
        looked_at.append(line)
        payload(folded, line, data)

    monkeypatch.setattr(StreamFold, "_payload", one)
    words = [f" w{i}" for i in range(300)]
    events = [role_event(), *map(text_event, words), finish_event(), DONE]
    events = [e.removesuffix(b"\n\n") + separator for e in events]
    folded = fold(events[:2])  # the role chunk, then the first text: the template
    looked_at.clear()
    folded.feed(b"".join(events[2:-2]))
    assert looked_at == []
    folded.feed(b"".join(events[-2:]))
    answer = folded.answer("chat", USAGE)
    assert answer is not None
    assert answer.message == {"role": "assistant", "content": "".join(words)}
    assert len(looked_at) == 2  # the finish chunk and [DONE]


def test_the_end_of_a_stream_is_cut_off_its_last_read_not_halved_down_to(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream's last read (or batch) is texts on the template, then its finish chunk and
    [DONE]: those two are cut off the end and the texts taken in one bulk call, not found by
    halving the read down to them."""
    monkeypatch.setattr(fold_module, "_BATCH_BYTES", 1)  # each read folded as it comes
    bulk: list[int] = []
    take = template_module.Template.take

    def counted(template: Any, data: bytes) -> bool:
        bulk.append(len(data))
        return take(template, data)

    monkeypatch.setattr(template_module.Template, "take", counted)
    words = [f" w{i}" for i in range(300)]
    events = [role_event(), *map(text_event, words), finish_event(), DONE]
    folded = fold(events[:2])  # the role chunk, then the first text: the template
    bulk.clear()
    folded.feed(b"".join(events[2:]))
    answer = folded.answer("chat", USAGE)
    assert answer is not None
    assert answer.message == {"role": "assistant", "content": "".join(words)}
    # The whole read (refused at once: it does not end on the template), then its texts.
    assert len(bulk) == 2


def test_only_chunks_off_the_template_are_parsed(parses: list[bytes]) -> None:
    pieces = long_text(700)
    events = [role_event(), *map(text_event, pieces), finish_event(), b"data: [DONE]\n\n"]
    answer = fold(events).answer("chat", USAGE)
    assert answer is not None
    escaped = sum(1 for p in pieces if b"\\" in orjson.dumps(p))
    assert len(parses) == 5 + escaped  # a text with an escape is parsed on its own
    assert escaped < len(pieces) // 10


def test_chunks_that_differ_each_time_are_parsed_and_still_exact(parses: list[bytes]) -> None:
    words = [f" w{i}" for i in range(300)]
    events = [
        b"data: " + orjson.dumps({**HEAD, "created": i, "choices": [{"delta": {"content": w}}]})
        for i, w in enumerate(words)
    ]
    stop = {**HEAD, "choices": [{"delta": {}, "finish_reason": "length"}]}
    events += [b"data: " + orjson.dumps(stop), b"data: [DONE]"]
    answer = fold([e + b"\n\n" for e in events]).answer("chat", USAGE)
    assert answer is not None
    assert (answer.message, answer.finish_reason) == (
        {"role": "assistant", "content": "".join(words)},
        "length",
    )
    assert len(parses) <= len(words) + 4 + 2  # each chunk once, a few probes, finish, decode


def test_a_backend_that_escapes_every_character_is_folded_exactly() -> None:
    pieces = [" café", " naïve", " 中"] * 50
    events = [
        b"data: " + json.dumps({**HEAD, "choices": [{"delta": {"content": p}}]}).encode()
        for p in pieces
    ]
    stop = {**HEAD, "choices": [{"delta": {}, "finish_reason": "stop"}]}
    events += [b"data: " + orjson.dumps(stop), b"data: [DONE]"]
    answer = fold([e + b"\r\n\r\n" for e in events]).answer("chat", USAGE)
    assert answer is not None
    assert answer.message == {"role": "assistant", "content": "".join(pieces)}


def test_tool_calls_reasoning_and_text_keep_their_order_and_parts() -> None:
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f"}}
    thoughts = [f" t{i}" for i in range(200)]
    words = [f" w{i}" for i in range(200)]
    events = [
        role_event(),
        *(text_event(t, "reasoning_content") for t in thoughts),
        *map(text_event, words),
        event(
            {
                "index": 0,
                "delta": {"tool_calls": [{**call, "function": {"name": "f", "arguments": "{"}}]},
            }
        ),
        event(
            {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}}
        ),
        finish_event("tool_calls"),
        b"data: [DONE]\n\n",
    ]
    answer = fold(events).answer("chat", USAGE)
    assert answer is not None
    assert answer.finish_reason == "tool_calls"
    assert answer.message == {
        "role": "assistant",
        "content": "".join(words),
        "reasoning_content": "".join(thoughts),
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }


def test_calls_without_an_index_fold_into_one_call_each_with_their_own_fields() -> None:
    """Google's OpenAI-compatible stream: each call whole, no `index`, a signature to send
    back. They were merged into one call (the last id and name, the arguments glued)."""

    signed = {"extra_content": {"google": {"thought_signature": "c2lnMA=="}}}
    first = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    second = {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"b"'}}
    events = [
        role_event(),
        calls({**first, **signed}),
        calls(second),
        calls({"id": "", "type": "", "function": {"arguments": ": 2}"}}),  # the same call
        finish_event("stop"),
        b"data: [DONE]\n\n",
    ]
    answer = fold(events).answer("chat", USAGE)
    assert answer is not None
    assert answer.message is not None
    assert answer.message["tool_calls"] == [
        {**first, **signed},
        {**second, "function": {"name": "g", "arguments": '{"b": 2}'}},
    ]


def test_a_long_text_completion_stream_folds_exactly(parses: list[bytes]) -> None:
    head = {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m"}
    words = [f" w{i}" for i in range(3000)]

    def chunk(text: str, finish: str | None = None) -> bytes:
        choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
        return b"data: " + orjson.dumps({**head, "choices": [choice]}) + b"\n\n"

    events = [*map(chunk, words), chunk("", "stop"), b"data: [DONE]\n\n"]
    answer = fold(events).answer("text_completion", USAGE)
    assert answer == Answer("text_completion", "m", "stop", USAGE, None, "".join(words))
    assert len(parses) == 4  # the first text, its probe, the finish chunk, the decode


WORDS = [text_event(f" w{i}") for i in range(50)]
DONE = b"data: [DONE]\n\n"


CUSTOM = [
    {"index": 0, "id": "c1", "type": "custom", "custom": {"name": "sh", "input": "ls "}},
    {"index": 0, "custom": {"input": "-l"}},
]
SIGNED_TWICE = [
    {"index": 0, "id": "c1", "function": {"name": "f"}, "extra_content": {"sig": "a"}},
    {"index": 0, "function": {"arguments": "{}"}, "extra_content": {"sig": "b"}},
]


@pytest.mark.parametrize(
    "events",
    [
        [*WORDS, finish_event()],  # cut: no [DONE]
        [*WORDS, DONE],  # no finish reason
        [*WORDS, finish_event("abort"), DONE],  # the engine aborted it (vLLM, SGLang)
        [*WORDS, event({"index": 0, "delta": {"content": [{"text": "b"}]}}), finish_event(), DONE],
        [*WORDS, finish_event(), DONE, DONE],
        [*WORDS, finish_event(), DONE, WORDS[0]],
        [*WORDS, b'data: {"error": {"message": "boom"}}\n\n', finish_event(), DONE],
        [*WORDS, b"data: {not json\n\n", finish_event(), DONE],
        [*WORDS, b'data: {"choices": ["x"]}\n\n', finish_event(), DONE],
        [*WORDS, b"data: [1]\n\n", finish_event(), DONE],
        [*WORDS, event({"index": 1, "delta": {"content": "b"}}), finish_event(), DONE],
        [*WORDS, text_event(" badXq").replace(b"X", b"\\"), finish_event(), DONE],  # no escape
        [*WORDS, b'data: {"id": 1,\ndata: "choices": []}\n\n', finish_event(), DONE],
        # a custom tool's input in pieces; a field of the backend's own twice for one call
        [*WORDS, *map(calls, CUSTOM), finish_event("tool_calls"), DONE],
        [*WORDS, *map(calls, SIGNED_TWICE), finish_event("tool_calls"), DONE],
    ],
)
def test_what_is_not_a_complete_plain_answer_is_refused(events: list[bytes]) -> None:
    assert fold(events).answer("chat", USAGE) is None
    assert from_stream("chat", b"".join(events), USAGE) is None


def test_a_chunk_with_two_choices_is_refused_even_on_the_template() -> None:
    two = {**HEAD, "system_fingerprint": "fp", "choices": [{"delta": {"content": "a"}}] * 2}
    events = [*WORDS, b"data: " + orjson.dumps(two) + b"\n\n", finish_event(), DONE]
    assert fold(events).answer("chat", USAGE) is None


def test_a_stream_past_its_limit_is_refused_and_stops_folding(
    parses: list[bytes], batch_bytes: int
) -> None:
    events = [role_event(), *WORDS, finish_event(), DONE]
    size = len(b"".join(events))
    assert fold(events, limit=size).answer("chat", USAGE) is not None
    parses.clear()
    assert fold(events, limit=size - 1).answer("chat", USAGE) is None  # [DONE] was one too many
    parses.clear()
    assert fold(events, limit=size // 2).answer("chat", USAGE) is None
    if batch_bytes == 1:  # each read folded as it comes
        assert len(parses) == 3  # nothing parsed once past the limit (role, first text, probe)
    else:  # nothing, or less, if the limit was passed before a batch was folded
        assert len(parses) <= 3


def test_a_template_is_never_taken_from_a_look_alike_field(parses: list[bytes]) -> None:
    """The text's bytes also appear in another field: no template, every chunk parsed, exact."""
    words = [f" w{i}" for i in range(40)]
    events = [
        b"data: "
        + orjson.dumps({**HEAD, "note": {"content": w}, "choices": [{"delta": {"content": w}}]})
        + b"\n\n"
        for w in words
    ]
    answer = fold([*events, finish_event(), DONE]).answer("chat", USAGE)
    assert answer is not None
    assert answer.message == {"role": "assistant", "content": "".join(words)}
    assert len(parses) == len(words) + 2  # no probe: the text was found twice


def test_a_template_only_takes_reads_whose_texts_are_plain() -> None:
    """An event that looks like the template but has a quote ends its text there, and adds a
    field: it is parsed, and its text is what it says, not the bytes up to the template's end."""
    events = [text_event(" a"), text_event(" b")]
    tricky = text_event(' c"},"x":{"y":"').replace(b"\\", b"")
    stream = [*events, tricky, finish_event(), DONE]
    answer = fold(stream, per_read=3).answer("chat", USAGE)
    assert answer is not None
    assert answer.message == {"role": "assistant", "content": " a b c"}
    assert (
        fold(stream).answer("chat", USAGE) == answer == from_stream("chat", b"".join(stream), USAGE)
    )


def test_padding_that_is_not_a_plain_string_is_parsed() -> None:
    words = [" a", " b", " c", " d"]
    paddings = ["ok", 'q"uote', "back\\slash", "ok"]
    events = [openai_event(w, p) for w, p in zip(words, paddings, strict=True)]
    stream = [*events, finish_event(), DONE]
    answer = fold(stream).answer("chat", USAGE)
    assert answer is not None
    assert answer.message == {"role": "assistant", "content": " a b c d"}
    assert fold(stream, per_read=2).answer("chat", USAGE) == answer


@pytest.mark.parametrize("per_read", [1, 2, 1 << 30])
def test_a_character_cut_across_two_events_is_not_stored(per_read: int) -> None:
    """A backend that sends a character's bytes in two events: a client reads each event as
    broken text, so a replay with the whole character would not be what it was sent."""
    emoji = "🙂".encode()
    halves = [
        text_event("X").replace(b'"X"', b'"' + half + b'"') for half in (emoji[:2], emoji[2:])
    ]
    cut = [text_event(" a"), text_event(" b"), *halves, text_event(" c"), finish_event(), DONE]
    assert fold(cut, per_read=per_read).answer("chat", USAGE) is None
    whole = [text_event(" a"), text_event(" b🙂"), text_event(" c"), finish_event(), DONE]
    answer = fold(whole, per_read=per_read).answer("chat", USAGE)
    assert answer is not None
    assert answer.message == {"role": "assistant", "content": " a b🙂 c"}
