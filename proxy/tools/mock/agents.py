"""The mock backend's Responses and Messages APIs: their requests read into the mock's
CompletionRequest, and their whole answers and stream events as OpenAI and Anthropic send them.

Responses streams: response.created, response.in_progress, response.output_item.added,
response.content_part.added, one response.output_text.delta per token, response.output_text.done,
response.content_part.done, response.output_item.done, then response.completed (or
response.incomplete when max_output_tokens cut it short), each with a sequence_number.
Messages streams: message_start, content_block_start, ping, one content_block_delta per token,
content_block_stop, message_delta (stop_reason, usage.output_tokens), message_stop.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Final

import orjson

from proxy.tools.mock.request import (
    TOKENS_PER_MESSAGE,
    CompletionRequest,
    Endpoint,
    MockHTTPError,
    bool_field,
    content_text,
    int_field,
    model_of,
)
from proxy.tools.mock.text import TokenSource, count_words

__all__ = ["EventFormat", "agent_answer", "agent_stream", "parse_agent"]

_SLOT: Final = "\x00token\x00"
_SLOT_JSON: Final = orjson.dumps(_SLOT)
_NUMBER: Final = -777_777_777  # stands for a sequence number in a pre-encoded event
_NUMBER_JSON: Final = str(_NUMBER).encode()


def parse_agent(body: dict[str, Any], endpoint: Endpoint) -> CompletionRequest:
    """A Responses or Messages request; Messages requires max_tokens, as Anthropic does."""
    model = model_of(body)
    if endpoint is Endpoint.RESPONSES:
        texts = _responses_texts(body)
        max_tokens = int_field(body, "max_output_tokens", low=1)
    else:
        texts = _messages_texts(body)
        max_tokens = int_field(body, "max_tokens", low=1)
        if max_tokens is None:
            raise MockHTTPError(400, "max_tokens: Field required", param="max_tokens")
    tokens = sum(count_words(text) for text in texts) + TOKENS_PER_MESSAGE * len(texts)
    return CompletionRequest(
        endpoint=endpoint,
        model=model,
        stream=bool_field(body, "stream"),
        include_usage=True,
        prompt_text="\n".join(texts),
        prompt_tokens=tokens,
        max_tokens=max_tokens,
    )


def _responses_texts(body: dict[str, Any]) -> list[str]:
    given = body.get("input")
    instructions = body.get("instructions")
    texts = [instructions] if isinstance(instructions, str) else []
    if isinstance(given, str):
        return [*texts, given]
    if not isinstance(given, list) or not given:
        raise MockHTTPError(400, "'input' must be a string or a non-empty array.", param="input")
    for item in given:
        if not isinstance(item, dict):
            raise MockHTTPError(400, "Each input item must be an object.", param="input")
        texts.append(content_text(item.get("content", item.get("output"))))
    return texts


def _messages_texts(body: dict[str, Any]) -> list[str]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise MockHTTPError(400, "messages: Input should be a non-empty list", param="messages")
    system = body.get("system")
    texts = [content_text(system)] if system else []
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise MockHTTPError(400, "Each message needs a role of user or assistant.")
        texts.append(content_text(message.get("content")))
    return texts


@dataclass(frozen=True, slots=True)
class _Answer:
    """What one answer says about itself, shared by its whole form and its stream events."""

    request: CompletionRequest
    body: dict[str, Any]
    created: int
    n_tokens: int
    cut_short: bool  # the output cap ended it
    answer_id: str
    item_id: str

    @classmethod
    def of(
        cls, request: CompletionRequest, body: dict[str, Any], created: int, n: int, finish: str
    ) -> _Answer:
        prefix = "resp_" if request.endpoint is Endpoint.RESPONSES else "msg_"
        item = "msg_" + uuid.uuid4().hex
        return cls(request, body, created, n, finish == "length", prefix + uuid.uuid4().hex, item)

    def response(self, text: str | None) -> dict[str, Any]:
        """The Responses API's response object: in progress (text None) or finished."""
        status = "in_progress" if text is None else "incomplete" if self.cut_short else "completed"
        output = [] if text is None else [self.item(text)]
        usage = None if text is None else self.responses_usage()
        body = self.body
        return {
            "id": self.answer_id, "object": "response", "created_at": self.created,
            "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "metadata": {},
            "model": self.request.model, "output": output, "parallel_tool_calls": True,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
            "store": False, "temperature": body.get("temperature", 1.0),
            "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [],
            "top_p": body.get("top_p", 1.0), "truncation": "disabled", "usage": usage,
            "user": None,
        }  # fmt: skip

    def item(self, text: str | None) -> dict[str, Any]:
        status = "in_progress" if text is None else "incomplete" if self.cut_short else "completed"
        content = [] if text is None else [_output_text(text)]
        return {
            "id": self.item_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def responses_usage(self) -> dict[str, Any]:
        prompt, n = self.request.prompt_tokens, self.n_tokens
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": n,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + n,
        }

    def message(self, text: str | None, output_tokens: int) -> dict[str, Any]:
        """The Messages API's message: as message_start shows it (text None) or whole."""
        return {
            "id": self.answer_id,
            "type": "message",
            "role": "assistant",
            "model": self.request.model,
            "content": [] if text is None else [{"type": "text", "text": text}],
            "stop_reason": None if text is None else self.stop_reason,
            "stop_sequence": None,
            "usage": {
                "input_tokens": self.request.prompt_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
                "output_tokens": output_tokens,
            },
        }

    @property
    def stop_reason(self) -> str:
        return "max_tokens" if self.cut_short else "end_turn"


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def agent_answer(
    request: CompletionRequest, body: dict[str, Any], created: int, text: str, n: int, finish: str
) -> bytes:
    """A whole Responses or Messages answer of `n` tokens."""
    answer = _Answer.of(request, body, created, n, finish)
    if request.endpoint is Endpoint.RESPONSES:
        return orjson.dumps(answer.response(text))
    return orjson.dumps(answer.message(text, n))


@dataclass(frozen=True, slots=True)
class EventFormat:
    """A named-event stream, pre-encoded: each token's event is prefix + token + suffix (and,
    when numbered, its sequence number + close)."""

    head: bytes
    prefix: bytes
    suffix: bytes
    numbered_from: int | None
    close: bytes
    tail: bytes

    def encode(self, tokens: TokenSource, start: int, stop: int, last: bool) -> bytes:
        parts = [self.head] if start == 0 else []
        first = self.numbered_from
        for i in range(start, stop):
            parts += (self.prefix, tokens.json(i), self.suffix)
            if first is not None:
                parts += (b"%d" % (first + i), self.close)
        if last:
            parts.append(self.tail)
        return b"".join(parts)


def _event(data: dict[str, Any]) -> bytes:
    kind: str = data["type"]
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def agent_stream(
    request: CompletionRequest,
    body: dict[str, Any],
    created: int,
    tokens: TokenSource,
    n: int,
    finish: str,
) -> EventFormat:
    answer = _Answer.of(request, body, created, n, finish)
    if request.endpoint is Endpoint.RESPONSES:
        return _responses_stream(answer, tokens.completion(n))
    return _messages_stream(answer)


def _responses_stream(answer: _Answer, text: str) -> EventFormat:
    item_id, n = answer.item_id, answer.n_tokens
    at: dict[str, Any] = {"item_id": item_id, "output_index": 0, "content_index": 0}
    started: list[dict[str, Any]] = [
        {"type": "response.created", "response": answer.response(None)},
        {"type": "response.in_progress", "response": answer.response(None)},
        {"type": "response.output_item.added", "output_index": 0, "item": answer.item(None)},
        {"type": "response.content_part.added", **at, "part": _output_text("")},
    ]
    ending = "response.incomplete" if answer.cut_short else "response.completed"
    ended: list[dict[str, Any]] = [
        {"type": "response.output_text.done", **at, "text": text, "logprobs": []},
        {"type": "response.content_part.done", **at, "part": _output_text(text)},
        {"type": "response.output_item.done", "output_index": 0, "item": answer.item(text)},
        {"type": ending, "response": answer.response(text)},
    ]
    delta = {"type": "response.output_text.delta", **at, "delta": _SLOT, "logprobs": []}
    encoded = _event({**delta, "sequence_number": _NUMBER})
    prefix, rest = encoded.split(_SLOT_JSON)
    suffix, close = rest.split(_NUMBER_JSON)
    numbered = len(started)
    return EventFormat(
        head=b"".join(_event({**e, "sequence_number": i}) for i, e in enumerate(started)),
        prefix=prefix,
        suffix=suffix,
        numbered_from=numbered,
        close=close,
        tail=b"".join(
            _event({**e, "sequence_number": numbered + n + i}) for i, e in enumerate(ended)
        ),
    )


def _messages_stream(answer: _Answer) -> EventFormat:
    started: list[dict[str, Any]] = [
        {"type": "message_start", "message": answer.message(None, 1)},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "ping"},
    ]
    stop = {"stop_reason": answer.stop_reason, "stop_sequence": None}
    ended: list[dict[str, Any]] = [
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": stop, "usage": {"output_tokens": answer.n_tokens}},
        {"type": "message_stop"},
    ]
    text_delta = {"type": "text_delta", "text": _SLOT}
    delta = {"type": "content_block_delta", "index": 0, "delta": text_delta}
    prefix, suffix = _event(delta).split(_SLOT_JSON)
    return EventFormat(
        head=b"".join(map(_event, started)),
        prefix=prefix,
        suffix=suffix,
        numbered_from=None,
        close=b"",
        tail=b"".join(map(_event, ended)),
    )
