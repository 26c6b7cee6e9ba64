"""The mock backend's Responses and Messages APIs: their requests read into the mock's
CompletionRequest, and their whole answers and stream events as OpenAI and Anthropic send them.

Responses streams: response.created, response.in_progress, response.output_item.added,
response.content_part.added, one response.output_text.delta per token, response.output_text.done,
response.content_part.done, response.output_item.done, then response.completed (or
response.incomplete when max_output_tokens cut it short), each with a sequence_number.
Messages streams: message_start, content_block_start, ping, one content_block_delta per token,
content_block_stop, message_delta (stop_reason, usage.output_tokens), message_stop.
A tool-calling answer (agentcalls.py) streams, for each call in turn, response.output_item.added,
one response.function_call_arguments.delta per piece, response.function_call_arguments.done and
response.output_item.done; or content_block_start (tool_use, input {}), one content_block_delta
(input_json_delta) per piece and content_block_stop. Events are pre-encoded (agentevents.py).
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.tools.mock.agentcalls import AgentCalls, messages_tool_plan, responses_tool_plan
from proxy.tools.mock.agentevents import (
    LOGPROBS_SLOT,
    SLOT,
    CallEventFormat,
    CallEvents,
    EventFormat,
    event,
    split_delta,
)
from proxy.tools.mock.kept import Transcript
from proxy.tools.mock.logprobs import Logprobs
from proxy.tools.mock.request import (
    MAX_TOP_LOGPROBS,
    TOKENS_PER_MESSAGE,
    CompletionRequest,
    Endpoint,
    MockHTTPError,
    bool_field,
    content_text,
    int_field,
    model_of,
)
from proxy.tools.mock.stream import StreamFormat
from proxy.tools.mock.text import TokenSource, count_words
from proxy.usageshape import responses_usage

__all__ = ["agent_answer", "agent_stream", "parse_agent"]

Body = dict[str, Any]  # a request's parsed JSON


def parse_agent(
    body: dict[str, Any], endpoint: Endpoint, history: Transcript | None = None
) -> CompletionRequest:
    """A Responses or Messages request; Messages requires max_tokens, as Anthropic does. A
    Responses request reads `history` (the stored conversation it continues) first."""
    model = model_of(body)
    if endpoint is Endpoint.RESPONSES:
        texts = _responses_texts(body)
        max_tokens = int_field(body, "max_output_tokens", low=1)
        store = body.get("store")
        if store is not None and not isinstance(store, bool):
            raise MockHTTPError(400, "'store' must be a boolean.", param="store")
        logprobs = _responses_logprobs(body)
    else:
        texts = _messages_texts(body)
        max_tokens = int_field(body, "max_tokens", low=1)
        if max_tokens is None:
            raise MockHTTPError(400, "max_tokens: Field required", param="max_tokens")
        logprobs = None
    tokens = sum(count_words(text) for text in texts) + TOKENS_PER_MESSAGE * len(texts)
    prompt = (history or Transcript("", 0)).then("\n".join(texts), tokens)
    request = CompletionRequest(
        endpoint=endpoint,
        model=model,
        stream=bool_field(body, "stream"),
        include_usage=True,
        prompt_text=prompt.text,
        prompt_tokens=prompt.tokens,
        max_tokens=max_tokens,
        logprobs=logprobs,
    )
    plan = responses_tool_plan if endpoint is Endpoint.RESPONSES else messages_tool_plan
    tools = plan(body, request.prompt_text)
    return request if tools is None else dataclasses.replace(request, tools=tools)


def _responses_logprobs(body: dict[str, Any]) -> int | None:
    """The top alternatives each token's logprobs list (`top_logprobs`, 0-20), when `include`
    asks for the output text's logprobs, as OpenAI gives them only then; else None."""
    top = int_field(body, "top_logprobs", low=0, high=MAX_TOP_LOGPROBS)
    include = body.get("include")
    if not isinstance(include, list) or "message.output_text.logprobs" not in include:
        return None
    return top or 0


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
    calls: AgentCalls | None  # a tool-calling answer's calls
    scores: Logprobs | None  # a text answer's, when asked for

    @classmethod
    def of(
        cls,
        request: CompletionRequest,
        body: Body,
        created: int,
        tokens: TokenSource,
        n: int,
        finish: str,
    ) -> _Answer:
        responses = request.endpoint is Endpoint.RESPONSES
        prefix = "resp_" if responses else "msg_"
        item = "msg_" + uuid.uuid4().hex
        cut = finish == "length"
        plan = request.tools
        calls = None if plan is None else AgentCalls.of(plan, n, cut, responses=responses)
        top = request.logprobs
        scores = None if top is None or calls is not None else Logprobs(tokens, n, top)
        answer_id = prefix + uuid.uuid4().hex
        return cls(request, body, created, n, cut, answer_id, item, calls, scores)

    def entries(self) -> list[dict[str, Any]]:
        """The text's logprobs, as an output_text part holds them ([] when not asked for)."""
        return [] if self.scores is None else self.scores.chat(0, self.n_tokens)["content"]

    def response(self, output: list[dict[str, Any]] | None) -> dict[str, Any]:
        """The Responses API's response object: in progress (output None) or finished."""
        done = output is not None
        status = ("incomplete" if self.cut_short else "completed") if done else "in_progress"
        usage = self.responses_usage() if done else None
        body = self.body
        return {
            "id": self.answer_id, "object": "response", "created_at": self.created,
            "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "metadata": {},
            "model": self.request.model, "output": output or [],
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": {"effort": None, "summary": None},
            "store": body.get("store") is not False, "temperature": body.get("temperature", 1.0),
            "text": {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "top_p": body.get("top_p", 1.0), "truncation": "disabled", "usage": usage,
            "user": None,
        }  # fmt: skip

    def output(self, text: str) -> list[dict[str, Any]]:
        """The finished response's output: its text message, or its function calls."""
        if self.calls is None:
            return [self.item(text)]
        return [self.calls.function_call(i, done=True) for i in range(len(self.calls.texts))]

    def item(self, text: str | None) -> dict[str, Any]:
        status = "in_progress" if text is None else "incomplete" if self.cut_short else "completed"
        content = [] if text is None else [_output_text(text, self.entries())]
        return {
            "id": self.item_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def responses_usage(self) -> dict[str, Any]:
        return responses_usage(self.request.prompt_tokens, self.n_tokens)

    def content(self, text: str) -> list[dict[str, Any]]:
        """The finished message's content: its text block, or its tool_use blocks."""
        if self.calls is None:
            return [{"type": "text", "text": text}]
        return [self.calls.tool_use(i, done=True) for i in range(len(self.calls.texts))]

    def message(self, content: list[dict[str, Any]] | None, output_tokens: int) -> dict[str, Any]:
        """The Messages API's message: as message_start shows it (content None) or whole."""
        return {
            "id": self.answer_id,
            "type": "message",
            "role": "assistant",
            "model": self.request.model,
            "content": content or [],
            "stop_reason": None if content is None else self.stop_reason,
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
        if self.cut_short:
            return "max_tokens"
        return "end_turn" if self.calls is None else "tool_use"


def _output_text(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def agent_answer(
    request: CompletionRequest, body: Body, created: int, tokens: TokenSource, n: int, finish: str
) -> bytes:
    """A whole Responses or Messages answer of `n` tokens."""
    answer = _Answer.of(request, body, created, tokens, n, finish)
    text = tokens.completion(n)
    if request.endpoint is Endpoint.RESPONSES:
        return orjson.dumps(answer.response(answer.output(text)))
    return orjson.dumps(answer.message(answer.content(text), n))


def agent_stream(
    request: CompletionRequest, body: Body, created: int, tokens: TokenSource, n: int, finish: str
) -> StreamFormat:
    answer = _Answer.of(request, body, created, tokens, n, finish)
    if request.endpoint is Endpoint.RESPONSES:
        return _responses_stream(answer, tokens.completion(n))
    return _messages_stream(answer)


def _responses_stream(answer: _Answer, text: str) -> StreamFormat:
    started: list[dict[str, Any]] = [
        {"type": "response.created", "response": answer.response(None)},
        {"type": "response.in_progress", "response": answer.response(None)},
    ]
    ending = "response.incomplete" if answer.cut_short else "response.completed"
    ended: list[dict[str, Any]] = [
        {"type": ending, "response": answer.response(answer.output(text))}
    ]
    if answer.calls is not None:
        calls = [_function_call_events(answer.calls, i) for i in range(len(answer.calls.texts))]
        plan = answer.calls.plan
        return CallEventFormat.build(plan, answer.n_tokens, started, calls, ended, numbered=True)
    at: dict[str, Any] = {"item_id": answer.item_id, "output_index": 0, "content_index": 0}
    started += [
        {"type": "response.output_item.added", "output_index": 0, "item": answer.item(None)},
        {"type": "response.content_part.added", **at, "part": _output_text("", [])},
    ]
    ended[:0] = [
        {"type": "response.output_text.done", **at, "text": text, "logprobs": answer.entries()},
        {"type": "response.content_part.done", **at, "part": _output_text(text, answer.entries())},
        {"type": "response.output_item.done", "output_index": 0, "item": answer.item(text)},
    ]
    logprobs = [] if answer.scores is None else LOGPROBS_SLOT
    delta = {"type": "response.output_text.delta", **at, "delta": SLOT, "logprobs": logprobs}
    prefix, suffix, close = split_delta(delta, numbered=True)
    numbered, n = len(started), answer.n_tokens
    return EventFormat(
        head=b"".join(event({**e, "sequence_number": i}) for i, e in enumerate(started)),
        prefix=prefix,
        suffix=suffix,
        numbered_from=numbered,
        close=close,
        tail=b"".join(
            event({**e, "sequence_number": numbered + n + i}) for i, e in enumerate(ended)
        ),
        scores=answer.scores,
    )


def _function_call_events(calls: AgentCalls, index: int) -> CallEvents:
    at: dict[str, Any] = {"item_id": calls.item_ids[index], "output_index": index}
    item = calls.function_call(index, done=True)
    opening = [
        {"type": "response.output_item.added", "output_index": index,
         "item": calls.function_call(index, done=False)},
    ]  # fmt: skip
    closing = [
        {"type": "response.function_call_arguments.done", **at,
         "name": item["name"], "arguments": item["arguments"]},
        {"type": "response.output_item.done", "output_index": index, "item": item},
    ]  # fmt: skip
    return opening, {"type": "response.function_call_arguments.delta", **at, "delta": SLOT}, closing


def _messages_stream(answer: _Answer) -> StreamFormat:
    started: list[dict[str, Any]] = [
        {"type": "message_start", "message": answer.message(None, 1)},
    ]
    stop = {"stop_reason": answer.stop_reason, "stop_sequence": None}
    ended: list[dict[str, Any]] = [
        {"type": "message_delta", "delta": stop, "usage": {"output_tokens": answer.n_tokens}},
        {"type": "message_stop"},
    ]
    if answer.calls is not None:
        calls = [_tool_use_events(answer.calls, i) for i in range(len(answer.calls.texts))]
        plan = answer.calls.plan
        return CallEventFormat.build(plan, answer.n_tokens, started, calls, ended, numbered=False)
    started += [
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "ping"},
    ]
    ended.insert(0, {"type": "content_block_stop", "index": 0})
    delta = {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": SLOT},
    }
    prefix, suffix, _ = split_delta(delta, numbered=False)
    return EventFormat(
        head=b"".join(map(event, started)),
        prefix=prefix,
        suffix=suffix,
        numbered_from=None,
        close=b"",
        tail=b"".join(map(event, ended)),
    )


def _tool_use_events(calls: AgentCalls, index: int) -> CallEvents:
    block = calls.tool_use(index, done=False)
    opening: list[dict[str, Any]] = [
        {"type": "content_block_start", "index": index, "content_block": block}
    ]
    if index == 0:
        opening.append({"type": "ping"})
    json_delta = {"type": "input_json_delta", "partial_json": SLOT}
    delta = {"type": "content_block_delta", "index": index, "delta": json_delta}
    return opening, delta, [{"type": "content_block_stop", "index": index}]
