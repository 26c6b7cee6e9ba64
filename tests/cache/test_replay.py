"""Stored answers: built from whole responses or complete streams, replayed as either."""

from __future__ import annotations

from dataclasses import fields, replace

import orjson

from proxy.cache.answer import Answer, from_response
from proxy.cache.fold import from_stream
from proxy.cache.replay import replay_response, replay_stream

USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


def sse(*chunks: dict[str, object], done: bool = True) -> bytes:
    events = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks)
    return events + (b"data: [DONE]\n\n" if done else b"")


def delta(d: dict[str, object], finish: str | None = None) -> dict[str, object]:
    return {"model": "m", "choices": [{"index": 0, "delta": d, "finish_reason": finish}]}


def test_a_complete_stream_is_merged_into_one_message() -> None:
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f"}}
    stream = sse(
        delta({"role": "assistant", "content": ""}),
        delta({"content": "Hello"}),
        delta({"content": " world"}),
        delta({"tool_calls": [{**call, "function": {"name": "f", "arguments": '{"a":'}}]}),
        delta({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
        delta({}, "tool_calls"),
    )
    answer = from_stream("chat", stream, USAGE)
    assert answer is not None
    assert answer.message == {
        "role": "assistant",
        "content": "Hello world",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
        ],
    }
    assert answer.finish_reason == "tool_calls"


def test_incomplete_or_failed_streams_give_no_answer() -> None:
    assert from_stream("chat", sse(delta({"content": "Hi"}), done=False), USAGE) is None
    assert from_stream("chat", sse(delta({"content": "Hi"})), USAGE) is None  # no finish
    error = {"error": {"message": "boom"}}
    assert from_stream("chat", sse(delta({"content": "Hi"}), error, done=False), USAGE) is None


def test_replayed_streams_merge_back_to_the_same_answer() -> None:
    text = "word " * 300
    original = Answer("chat", "m", "stop", USAGE, {"role": "assistant", "content": text})
    replayed = replay_stream(original, 1, include_usage=True)
    again = from_stream("chat", replayed, USAGE)
    assert again is not None
    assert again.message == original.message
    chunks = [orjson.loads(e[6:]) for e in replayed.split(b"\n\n") if e and b"[DONE]" not in e]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["usage"] == USAGE
    assert chunks[-1]["choices"] == []
    assert 10 < len(chunks) < 60  # a few words per chunk, not one chunk per character


def test_text_completions_replay_whole_and_streamed() -> None:
    body = {"model": "m", "choices": [{"index": 0, "text": "Hi there", "finish_reason": "stop"}]}
    answer = from_response("text_completion", body, USAGE)
    assert answer is not None
    whole = orjson.loads(replay_response(answer, 5))
    assert (whole["object"], whole["choices"][0]["text"], whole["usage"]) == (
        "text_completion",
        "Hi there",
        USAGE,
    )
    streamed = from_stream("text_completion", replay_stream(answer, 5, include_usage=False), USAGE)
    assert streamed is not None
    assert streamed.text == "Hi there"


def test_answers_round_trip_through_their_encoding() -> None:
    answer = Answer(
        "chat", "m", "stop", USAGE, {"role": "assistant", "content": "中文"}, None, "fp", 9.5
    )
    assert Answer.decode(answer.encode()) == answer


def test_an_answer_given_an_expiry_keeps_every_other_field() -> None:
    """`expiring` copies the answer field by field: a field it left out would be lost from
    every answer the cache stores (`stored`, the bytes an answer was read from, is not one)."""
    message = {"role": "assistant", "content": "hi"}
    answer = Answer("chat", "m", "length", USAGE, message, "t", "fp_1", expires_wall=1.0)
    assert all(getattr(answer, f.name) != getattr(Answer("", "", "", {}), f.name)
               for f in fields(Answer) if f.compare)  # fmt: skip
    assert answer.expiring(99.5) == replace(answer, expires_wall=99.5)


def test_reasoning_under_either_name_is_stored_and_replayed() -> None:
    """vLLM (0.11 on), OpenRouter and Ollama stream `reasoning`; llama.cpp `reasoning_content`:
    a hit gives the thinking back under the name it came in (it was dropped for `reasoning`)."""
    for name in ("reasoning", "reasoning_content"):
        stream = sse(
            delta({"role": "assistant", "content": ""}),
            delta({name: "think "}),
            delta({name: "more"}),
            delta({"content": "Hi"}),
            delta({}, "stop"),
        )
        answer = from_stream("chat", stream, USAGE)
        assert answer is not None
        assert answer.message == {"role": "assistant", "content": "Hi", name: "think more"}
        assert from_stream("chat", replay_stream(answer, 5, include_usage=False), USAGE) == answer
        whole = orjson.loads(replay_response(answer, 5))
        assert whole["choices"][0]["message"][name] == "think more"


def test_a_stream_with_a_delta_field_a_hit_could_not_give_back_is_not_stored() -> None:
    stream = sse(
        delta({"role": "assistant", "content": ""}),
        delta({"content": "Hi", "refusal": None}),  # a null field is nothing lost
        delta({"audio": {"id": "a1", "data": "UklGR"}}),
        delta({}, "stop"),
    )
    assert from_stream("chat", stream, USAGE) is None
    without = sse(delta({"content": "Hi", "refusal": None}), delta({}, "stop"))
    assert from_stream("chat", without, USAGE) is not None
