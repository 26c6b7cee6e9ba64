"""The mock backend's logprobs, as the openai SDK reads them, direct and through a gateway:
OpenAI's shapes, consistent with the text, alike in a stream and a whole answer."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from proxy.app import create_app as create_gateway
from tests.servers import serve
from tests.tools.test_mock_toolcalls import mock_url, sdk
from tests.web.test_billing import AUTH, billing_policy

MESSAGES: Any = [{"role": "user", "content": "tell me a story"}]

__all__ = ["mock_url", "sdk"]  # fixtures


def test_chat_logprobs_are_openais_shape_and_agree_with_the_text(sdk: openai.OpenAI) -> None:
    """They were `null` whatever was asked."""
    answer = sdk.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=6, logprobs=True, top_logprobs=3
    )
    choice = answer.choices[0]
    assert choice.logprobs is not None
    entries = choice.logprobs.content
    assert entries is not None
    assert len(entries) == 6
    assert "".join(entry.token for entry in entries) == choice.message.content
    for entry in entries:
        assert entry.bytes == list(entry.token.encode())
        assert -math.inf < entry.logprob < 0
        top = entry.top_logprobs
        assert len(top) == 3
        assert (top[0].token, top[0].logprob) == (entry.token, entry.logprob)
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        assert len({t.token for t in top}) == 3
        assert sum(math.exp(t.logprob) for t in top) <= 1
    plain = sdk.chat.completions.create(model="m", messages=MESSAGES, max_tokens=6, logprobs=True)
    assert plain.choices[0].logprobs is not None
    assert [e.top_logprobs for e in plain.choices[0].logprobs.content or []] == [[]] * 6
    unasked = sdk.chat.completions.create(model="m", messages=MESSAGES, max_tokens=6)
    assert unasked.choices[0].logprobs is None


def test_a_chat_streams_logprobs_token_by_token_as_the_whole_answer_has_them(
    sdk: openai.OpenAI,
) -> None:
    asked: dict[str, Any] = {"max_tokens": 5, "logprobs": True, "top_logprobs": 2, "n": 2}
    whole = sdk.chat.completions.create(model="m", messages=MESSAGES, **asked)
    stream = sdk.chat.completions.create(model="m", messages=MESSAGES, stream=True, **asked)
    streamed: dict[int, list[Any]] = {0: [], 1: []}
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                assert choice.logprobs is not None
                assert len(choice.logprobs.content or []) == 1
                streamed[choice.index] += choice.logprobs.content or []
    for choice in whole.choices:
        assert choice.logprobs is not None
        assert streamed[choice.index] == choice.logprobs.content


def test_completions_logprobs_are_openais_shape_in_a_stream_and_whole(sdk: openai.OpenAI) -> None:
    whole = sdk.completions.create(model="m", prompt="once upon", max_tokens=5, logprobs=2)
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None
    tokens, offsets = logprobs.tokens or [], logprobs.text_offset or []
    assert "".join(tokens) == whole.choices[0].text
    assert offsets == [len("".join(tokens[:i])) for i in range(5)]
    for token, logprob, top in zip(
        tokens, logprobs.token_logprobs or [], logprobs.top_logprobs or [], strict=True
    ):
        assert len(top) == 2
        assert top[token] == logprob == max(top.values())
    stream = sdk.completions.create(
        model="m", prompt="once upon", max_tokens=5, logprobs=2, stream=True
    )
    pieces = [chunk.choices[0].logprobs for chunk in stream]
    assert [p.tokens for p in pieces if p] == [[t] for t in tokens]
    assert [p.text_offset for p in pieces if p] == [[o] for o in offsets]
    assert [p.top_logprobs for p in pieces if p] == [[t] for t in logprobs.top_logprobs or []]


def test_top_logprobs_without_logprobs_or_past_20_is_a_400(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(model="m", messages=MESSAGES, top_logprobs=2)
    assert caught.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.completions.create(model="m", prompt="hi", logprobs=21)
    assert caught.value.param == "logprobs"


def test_a_gateway_relays_logprobs_intact(mock_url: str, tmp_path: Path) -> None:
    body = {
        "model": "exact-llm",
        "messages": MESSAGES,
        "max_tokens": 4,
        "logprobs": True,
        "top_logprobs": 2,
    }
    direct = _choices(mock_url, body), _choices(mock_url, {**body, "stream": True})
    with serve(create_gateway(billing_policy(mock_url, tmp_path / "ledger.db"))) as gateway:
        relayed = _choices(gateway, body), _choices(gateway, {**body, "stream": True})
    assert relayed == direct
    assert direct[0][0][0]["logprobs"]["content"]


def _choices(url: str, body: dict[str, Any]) -> list[Any]:
    """Each answer's or stream event's `choices`, as sent."""
    answer = httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=10)
    assert answer.status_code == 200
    if not body.get("stream"):
        return [answer.json()["choices"]]
    events = answer.text.split("\n\n")
    return [orjson.loads(e[6:])["choices"] for e in events if e.startswith("data: {")]


def test_responses_give_logprobs_when_include_asks_in_a_stream_and_whole(
    sdk: openai.OpenAI, mock_url: str, tmp_path: Path
) -> None:
    asked: dict[str, Any] = {
        "model": "exact-llm",
        "input": "tell me a story",
        "max_output_tokens": 4,
        "top_logprobs": 2,
        "include": ["message.output_text.logprobs"],
    }
    whole = sdk.responses.create(**asked)
    entries = whole.model_dump()["output"][0]["content"][0]["logprobs"]
    assert "".join(entry["token"] for entry in entries) == whole.output_text
    assert [len(entry["top_logprobs"]) for entry in entries] == [2] * 4
    deltas: list[Any] = []
    for event in sdk.responses.create(stream=True, **asked):
        if event.type == "response.output_text.delta":
            deltas += [entry.model_dump() for entry in event.logprobs]
    assert deltas == entries
    unasked = sdk.responses.create(model="m", input="tell me a story", max_output_tokens=4)
    assert unasked.model_dump()["output"][0]["content"][0]["logprobs"] == []
    with serve(create_gateway(billing_policy(mock_url, tmp_path / "ledger.db"))) as gateway:
        relayed = httpx.post(gateway + "/v1/responses", json=asked, headers=AUTH, timeout=10)
    assert relayed.json()["output"][0]["content"][0]["logprobs"] == entries
