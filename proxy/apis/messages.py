"""Anthropic's Messages API (`POST /v1/messages`): the fields the gateway reads, its messages as
chat messages (to count them), its usage (input in `message_start`, output in `message_delta`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import orjson

from proxy.apis.events import ANSWER_ID, StreamEvents, text_pattern, type_pattern
from proxy.apis.responses import chat_tool
from proxy.jsontext import json_text
from proxy.stages.jsoncheck import (
    Check,
    an_object,
    array_of,
    boolean,
    by_type,
    fields,
    integer,
    number,
    one_of,
    string,
)
from proxy.stages.openai_schema import MAX_TOKENS_CAP

__all__ = [
    "COUNT_CHECKS",
    "EVENTS",
    "MESSAGES",
    "OPTIONAL",
    "add_system",
    "answer_texts",
    "chat_usage",
    "container_id",
    "to_chat",
]

_BLOCK = fields({"type": string, "text": string})
_BLOCKS = array_of(_BLOCK)
_CONTENT = by_type("a string or an array of content blocks", {str: string, list: _BLOCKS})
_MESSAGE = fields({"role": one_of("user", "assistant"), "content": _CONTENT}, required=("role",))
MESSAGES = array_of(_MESSAGE, non_empty=True)
_SYSTEM = by_type("a string or an array of text blocks", {str: string, list: _BLOCKS})

COUNT_CHECKS: Mapping[str, Check] = {
    "system": _SYSTEM,
    "tools": array_of(fields({"name": string, "input_schema": an_object})),
    "tool_choice": an_object,
}
"""The fields of `POST /v1/messages/count_tokens` beside model and messages."""

OPTIONAL: Mapping[str, Check] = {
    **COUNT_CHECKS,
    "stream": boolean,
    "max_tokens": integer(1, MAX_TOKENS_CAP),
    "temperature": number(0.0, 1.0),
    "top_p": number(0.0, 1.0),
    "top_k": integer(0, 2**31 - 1),
    "stop_sequences": array_of(string),
    # user_id is the end user the request is attributed to: one of another type went
    # unattributed (Anthropic refuses it)
    "metadata": fields({"user_id": string}),
}

_CACHE_INPUT = ("cache_creation_input_tokens", "cache_read_input_tokens")
# What the counters estimate as media: Anthropic's images, and documents given as files (a PDF).
_MEDIA: Mapping[str, Any] = {"type": "image_url", "image_url": {}}
_FILE_SOURCES = ("base64", "url", "file")


def to_chat(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The system prompt and messages as chat messages, and the tools as chat tools."""
    chat: list[dict[str, Any]] = []
    system = body.get("system")
    if isinstance(system, str) and system:
        chat.append({"role": "system", "content": system})
    elif isinstance(system, list):
        chat.append({"role": "system", "content": [_part(block) for block in system]})
    for message in body.get("messages") or ():
        if isinstance(message, dict):
            chat += _chat_messages(message)
    tools = [
        chat_tool(tool.get("name"), tool.get("description"), tool.get("input_schema"))
        for tool in body.get("tools") or ()
        if isinstance(tool, dict)
    ]
    return chat, tools or None


def _chat_messages(message: dict[str, Any]) -> list[dict[str, Any]]:
    """One message as chat messages: its tool results become tool messages of their own."""
    role, content = message.get("role") or "user", message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    parts: list[object] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for block in content if isinstance(content, list) else ():
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use":
            arguments = orjson.dumps(block.get("input") or {}).decode()
            function = {"name": block.get("name") or "", "arguments": arguments}
            calls.append({"id": block.get("id") or "", "type": "function", "function": function})
        elif kind == "tool_result" and role == "assistant":
            parts.append({"type": "text", "text": f"Tool result: {_result(block)}"})
        elif kind == "tool_result":
            call_id = block.get("tool_use_id") or ""
            results.append({"role": "tool", "tool_call_id": call_id, "content": _result(block)})
        else:
            parts.append(_part(block))
    chat: list[dict[str, Any]] = [{"role": role, "content": parts}] if parts or calls else []
    if calls:
        chat[0]["tool_calls"] = calls
    return results + chat


def _part(block: object) -> object:
    """A content block as the chat part the counters read. Text and thinking blocks are chat's
    parts already; an image, and a document that is a file, are media; any other block (a
    document given as text, a search result, ...) is left as it is, and so counted as its JSON
    text, the most of it a backend can render (proxy/tokens/parts.py)."""
    if not isinstance(block, dict):
        return block
    kind = block.get("type")
    if kind == "image":
        return _MEDIA
    if kind == "document":
        source = block.get("source")
        if isinstance(source, dict) and source.get("type") in _FILE_SOURCES:
            return _MEDIA
    return block


def _result(block: dict[str, Any]) -> str:
    """A tool result's content as vLLM writes it into the prompt, the user's as the assistant's:
    a string as it is, blocks whole (Python's repr of them, an image's data included), counted
    as their JSON. Read as parts, an image's `data` counted 765 tokens however much text it
    held."""
    given = block.get("content")
    if isinstance(given, str):
        return given
    return _json(given) if given else ""


def _json(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def chat_usage(usage: Mapping[str, Any]) -> dict[str, Any]:
    """The usage in chat's names: input counts the prompt-cache writes and reads too (Anthropic
    reports them apart), so that a number checked_usage will not believe stays unbelieved."""
    prompt: object = usage.get("input_tokens")
    for name in _CACHE_INPUT:
        extra = usage.get(name)
        if extra is None:
            continue
        if type(extra) is int and extra >= 0 and type(prompt) is int:
            prompt += extra
        else:
            prompt = extra if type(extra) is not int else -1
    return {"prompt_tokens": prompt, "completion_tokens": usage.get("output_tokens")}


def answer_texts(answer: Mapping[str, Any]) -> list[str]:
    """The generated texts of a whole message: text, thinking, tool calls."""
    texts: list[str] = []
    for block in answer.get("content") or ():
        if not isinstance(block, dict):
            continue
        if block.get("type") == "tool_use":
            texts += [block.get("name") or "", json_text(block.get("input") or {})]
        else:
            texts.append(block.get("text") or block.get("thinking") or "")
    return [text for text in texts if isinstance(text, str)]


def add_system(body: dict[str, Any], system_prompt: str) -> bool:
    """Put the tenant's system prompt first in `system`; True if the body changed. A first
    block that has the prompt's text is the prompt only if it is a text block: vLLM reads a
    system list's text blocks alone, so a `"type": "document"` one carrying the text kept the
    prompt out of the model."""
    given = body.get("system")
    if isinstance(given, list):
        first = given[0] if given else None
        if (
            isinstance(first, dict)
            and first.get("type") == "text"
            and first.get("text") == system_prompt
        ):
            return False
        body["system"] = [{"type": "text", "text": system_prompt}, *given]
        return True
    if isinstance(given, str) and given.startswith(system_prompt):
        return False
    body["system"] = system_prompt if not given else f"{system_prompt}\n\n{given}"
    return True


def _read_usage(event: dict[str, Any], parts: dict[str, Any]) -> dict[str, Any] | None:
    """message_start has the input (and a first output count), message_delta the final output
    (newer backends repeat the input there): the usage is whole at message_delta."""
    if event.get("type") == "message_start":
        message = event.get("message")
        if not isinstance(message, dict):
            return None
        _note_container(parts, message.get("container"))
        usage = message.get("usage")
        if isinstance(usage, dict):
            _merge(parts, usage)
        return None
    delta = event.get("delta")
    if isinstance(delta, dict):
        _note_container(parts, delta.get("container"))
    usage = event.get("usage")
    if not isinstance(usage, dict):
        return None
    _merge(parts, usage)
    return dict(parts)


def _note_container(parts: dict[str, Any], container: object) -> None:
    """The code-execution container the answer ran in (Anthropic's), by its id: a later request
    may name it to run in it again."""
    if isinstance(container, dict) and container.get("id") is not None:
        parts[ANSWER_ID] = container["id"]


def container_id(answer: Mapping[str, Any]) -> object:
    """The id of the container a whole answer ran in, if it names one."""
    container = answer.get("container")
    return container.get("id") if isinstance(container, dict) else None


def _merge(parts: dict[str, Any], usage: dict[str, Any]) -> None:
    """A stream's counts are cumulative (Anthropic's rule): a later count below one already
    given is not believed to lower it (a message_delta's `input_tokens: 0` after 40 in
    message_start billed no input). Anything but an int replaces, for the checks to judge."""
    for name, value in usage.items():
        if value is None:
            continue
        known = parts.get(name)
        if type(value) is int and type(known) is int and value < known:
            continue
        parts[name] = value


EVENTS = StreamEvents(
    delta=type_pattern("content_block_delta"),
    text=text_pattern("text|thinking|partial_json"),
    opens=type_pattern("content_block_start"),
    call=type_pattern("(?:server_|mcp_)?tool_use"),
    usage=type_pattern("message_start|message_delta|error"),
    completes=type_pattern("message_delta"),
    last=type_pattern("message_stop"),
    read_usage=_read_usage,
    failures=frozenset({"error"}),  # Anthropic's (and vLLM's) error event, under the 200
)
