"""The mock backend's answers, by endpoint: whole JSON bodies and pre-encoded stream formats
(chat and completions here; Responses and Messages in agents.py)."""

from __future__ import annotations

import base64
import dataclasses
import uuid
from typing import Any

import orjson

from proxy.tools.mock.agents import agent_answer, agent_stream, parse_agent
from proxy.tools.mock.kept import Transcript
from proxy.tools.mock.logprobs import Logprobs, ScoredFormat
from proxy.tools.mock.request import (
    CompletionRequest,
    EmbeddingRequest,
    Endpoint,
    parse_completion,
)
from proxy.tools.mock.stream import ChoicesFormat, SseFormat, StreamFormat, tail_events
from proxy.tools.mock.text import TokenSource, embedding_bytes, embedding_floats
from proxy.tools.mock.toolcalls import ToolCallFormat, tool_plan

__all__ = ["embedding_answer", "parse_request", "stream_format", "whole_answer"]

_AGENTS = (Endpoint.RESPONSES, Endpoint.MESSAGES)


def parse_request(
    body: dict[str, Any], endpoint: Endpoint, history: Transcript | None = None
) -> CompletionRequest:
    """The request; a Responses request continues `history`, its stored conversation."""
    if endpoint in _AGENTS:
        return parse_agent(body, endpoint, history)
    request = parse_completion(body, endpoint)
    if endpoint is Endpoint.CHAT:
        tools = tool_plan(body, request.prompt_text)
        if tools is not None:
            request = dataclasses.replace(request, tools=tools)
    return request


def _base(request: CompletionRequest, created: int, *, stream: bool) -> dict[str, Any]:
    """The fields every answer and chunk of one chat or text completion share."""
    if request.endpoint is Endpoint.CHAT:
        kind = "chat.completion.chunk" if stream else "chat.completion"
        completion_id = "chatcmpl-" + uuid.uuid4().hex
    else:
        kind = "text_completion"
        completion_id = "cmpl-" + uuid.uuid4().hex
    return {"id": completion_id, "object": kind, "created": created, "model": request.model}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def stream_format(
    request: CompletionRequest,
    body: dict[str, Any],
    created: int,
    tokens: TokenSource,
    n_tokens: int,
    finish_reason: str,
) -> StreamFormat:
    if request.endpoint in _AGENTS:
        return agent_stream(request, body, created, tokens, n_tokens, finish_reason)
    answers = request.answers
    usage = _usage(request.prompt_tokens, n_tokens * answers) if request.include_usage else None
    base = _base(request, created, stream=True)
    top = request.logprobs
    scores = None if top is None or request.tools else Logprobs(tokens, n_tokens, top)
    if answers == 1:
        return _choice_format(request, base, usage, finish_reason, 0, scores)
    formats = [
        _choice_format(request, base, usage, finish_reason, index, scores)
        for index in range(answers)
    ]
    heads = b"".join(f.head for f in formats if not isinstance(f, ToolCallFormat))
    # Each choice's events, without the heads sent first and the tail all share
    alone = [dataclasses.replace(f, tail=b"") for f in formats]
    alone = [
        f if isinstance(f, ToolCallFormat) else dataclasses.replace(f, head=b"") for f in alone
    ]
    return ChoicesFormat(heads, tuple(alone), tail_events(base, usage))


def _choice_format(
    request: CompletionRequest,
    base: dict[str, Any],
    usage: dict[str, int] | None,
    finish_reason: str,
    index: int,
    scores: Logprobs | None,
) -> SseFormat | ScoredFormat | ToolCallFormat:
    """One choice's whole stream, head to tail; its tokens' logprobs in it when `scores`."""
    if request.tools is not None:
        return ToolCallFormat.build(base, request.tools, finish_reason, usage, index)
    chat = request.endpoint is Endpoint.CHAT
    build = SseFormat.chat if chat else SseFormat.completion
    plain = build(base, finish_reason, usage, index)
    if scores is None:
        return plain
    with_usage = usage is not None
    return ScoredFormat(
        base, with_usage, index, chat, finish_reason, scores, plain.head, plain.tail
    )


def whole_answer(
    request: CompletionRequest,
    body: dict[str, Any],
    created: int,
    tokens: TokenSource,
    n_tokens: int,
    finish_reason: str,
) -> bytes:
    if request.endpoint in _AGENTS:
        return agent_answer(request, body, created, tokens, n_tokens, finish_reason)
    text = tokens.completion(n_tokens)
    chat = request.endpoint is Endpoint.CHAT
    if chat:
        content: dict[str, Any] = {"message": {"role": "assistant", "content": text}}
    else:
        content = {"text": text}
    logprobs: dict[str, Any] | None = None
    if request.logprobs is not None and request.tools is None:
        scores = Logprobs(tokens, n_tokens, request.logprobs)
        logprobs = scores.chat(0, n_tokens) if chat else scores.completion(0, n_tokens)
    ending = {"logprobs": logprobs, "finish_reason": finish_reason}
    choices = [{"index": index, **content, **ending} for index in range(request.answers)]
    if request.tools is not None:  # each choice's calls with ids of their own
        for choice in choices:
            choice["message"] = request.tools.message(n_tokens)
    answer = _base(request, created, stream=False)
    usage = _usage(request.prompt_tokens, n_tokens * request.answers)
    answer |= {"choices": choices, "usage": usage}
    return orjson.dumps(answer)


def embedding_answer(request: EmbeddingRequest) -> bytes:
    data: list[dict[str, Any]] = []
    for index, key in enumerate(request.keys):
        packed = embedding_bytes(key, request.dimensions)
        vector: object = (
            base64.b64encode(packed).decode() if request.base64 else embedding_floats(packed)
        )
        data.append({"object": "embedding", "index": index, "embedding": vector})
    usage = {"prompt_tokens": request.prompt_tokens, "total_tokens": request.prompt_tokens}
    return orjson.dumps({"object": "list", "data": data, "model": request.model, "usage": usage})
