"""OpenAI's Responses API (`POST /v1/responses`): the fields the gateway reads, its input as chat
messages (to count it), its usage (`input_tokens`/`output_tokens`) and its stream events."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.apis.events import ANSWER_ID, StreamEvents, text_pattern, type_pattern
from proxy.errors import BadRequest
from proxy.stages.jsoncheck import (
    Check,
    an_object,
    array_of,
    boolean,
    by_type,
    fields,
    integer,
    number,
    string,
    values_of,
)
from proxy.stages.openai_schema import MAX_TOKENS_CAP

__all__ = [
    "EVENTS",
    "INPUT",
    "OPTIONAL",
    "add_system",
    "answer_texts",
    "chat_tool",
    "chat_usage",
    "names_stored_item",
    "to_chat",
]

_PART = fields({"type": string, "text": string})
_CONTENT = by_type("a string or an array of content parts", {str: string, list: array_of(_PART)})
_ITEM = fields({"type": string, "role": string, "content": _CONTENT})
INPUT = by_type("a string or an array of input items", {str: string, list: array_of(_ITEM)})


def _foreground(value: object, param: str) -> None:
    """`background: true` is refused: the backend would answer `queued` at once and generate
    after the request has ended, outside the key's quotas, concurrency and billing (and the
    gateway does not serve `GET /v1/responses/{id}`, where its result would be read)."""
    boolean(value, param)
    if value:
        raise BadRequest(
            "'background' is not supported by this gateway: a background response goes on "
            "after its request ends, where the key's limits and billing cannot follow it. "
            "Send the request without it (stream it for a long answer).",
            param=param,
            code="unsupported_parameter",
        )


OPTIONAL: Mapping[str, Check] = {
    "stream": boolean,
    "background": _foreground,
    "max_output_tokens": integer(1, MAX_TOKENS_CAP),
    "temperature": number(0.0, 2.0),
    "top_p": number(0.0, 1.0),
    "instructions": string,
    "tools": array_of(an_object),
    "metadata": values_of(string),
    "user": string,
    "store": boolean,
    "parallel_tool_calls": boolean,
    "previous_response_id": string,
}


def names_stored_item(item: object) -> bool:
    """An input item that names a stored item by its id (an `item_reference`, whose type may be
    left out): the backend reads the stored item in its place."""
    if type(item) is not dict:
        return False
    kind = item.get("type")
    return kind == "item_reference" or (kind is None and "role" not in item and "id" in item)


def to_chat(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The instructions and input as chat messages, and the tools as chat tools."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        messages += [_message(item) for item in given if isinstance(item, dict)]
    tools = [_tool(tool) for tool in body.get("tools") or () if isinstance(tool, dict)]
    return messages, tools or None


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as a chat tool: a function whole, as vLLM hands it to the chat template (every
    key of it, an unknown one too, which a template's `tojson` renders); any other (a custom
    tool's grammar, an MCP server's, a built-in's settings) as a function whose parameters are
    the rest of it, since what it carries may reach the prompt and must not go uncounted."""
    if tool.get("type") == "function":
        return {"type": "function", "function": tool}
    rest = {key: value for key, value in tool.items() if key not in ("name", "description")}
    return chat_tool(tool.get("name") or tool.get("type"), tool.get("description"), rest)


def chat_tool(name: object, description: object, parameters: object) -> dict[str, Any]:
    """A function tool as chat requests declare it."""
    function = {"name": name or "", "description": description or "", "parameters": parameters}
    return {"type": "function", "function": function}


def _message(item: dict[str, Any]) -> dict[str, Any]:
    """One input item as a chat message. Its content parts stay as they are: the counters know
    the Responses API's part types (proxy/tokens/parts.py)."""
    kind = item.get("type")
    if kind == "function_call":
        call = {"name": item.get("name") or "", "arguments": item.get("arguments") or ""}
        tool_call = {"id": item.get("call_id") or "", "type": "function", "function": call}
        return {"role": "assistant", "content": "", "tool_calls": [tool_call]}
    if kind == "function_call_output":
        output = item.get("output")
        return {
            "role": "tool",
            "tool_call_id": item.get("call_id") or "",
            # An object (or a number) is no part list: counted whole, as its JSON text (it
            # counted nothing, so a tool's output could carry any input past the limit).
            "content": output if isinstance(output, str | list | None) else [output],
        }
    if kind == "reasoning":
        return {"role": "assistant", "content": _reasoning_texts(item)}
    if kind not in (None, "message"):
        # Another item (a custom tool's call or output, an MCP call, ...): counted as its JSON
        # text, the most of it a backend can render.
        return {"role": "user", "content": [item]}
    role = item.get("role")
    content = item.get("content")
    return {
        "role": role if isinstance(role, str) else "user",
        "content": content if isinstance(content, str | list) else [],
    }


def _reasoning_texts(item: dict[str, Any]) -> list[object]:
    """A reasoning item's summary and reasoning texts as text parts (its encrypted content is
    opaque: only OpenAI reads it, and what it holds cannot be counted here)."""
    parts: list[object] = []
    for field in ("summary", "content"):
        given = item.get(field)
        if isinstance(given, list):
            parts += [_as_text(part) for part in given]
    return parts


def _as_text(part: object) -> object:
    """A summary or reasoning part with a string `text` as a text part; else as it is (counted
    as its JSON)."""
    if isinstance(part, dict) and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    return part


_CONTRADICTED = "<contradicts the usage's other numbers>"
"""The total of a usage that contradicts itself: no count, so no check believes it (and the
gateway's warning says why)."""


def chat_usage(usage: Mapping[str, Any]) -> dict[str, Any]:
    """The usage in chat's names; checked_usage then judges the numbers. A usage that
    contradicts itself is given a total it cannot believe: the whole usage is then the
    gateway's own counts, shown in its place, since which of its numbers lies cannot be known
    (the client was shown a total of 5 beside a bill of 21, a cached count of 900 out of 9)."""
    given_in, given_out = usage.get("input_tokens"), usage.get("output_tokens")
    total = usage.get("total_tokens")
    if type(given_in) is int and type(given_out) is int and not _consistent(usage):
        total = _CONTRADICTED
    return {"prompt_tokens": given_in, "completion_tokens": given_out, "total_tokens": total}


def _consistent(usage: Mapping[str, Any]) -> bool:
    """The Responses API's (OpenAI's, vLLM's) total is input + output; its cached tokens are a
    part of the input, its reasoning tokens a part of the output."""
    given_in, given_out = usage["input_tokens"], usage["output_tokens"]
    total = usage.get("total_tokens")
    if total is not None and (type(total) is not int or total != given_in + given_out):
        return False
    return _part_of(usage, "input_tokens_details", "cached_tokens", given_in) and _part_of(
        usage, "output_tokens_details", "reasoning_tokens", given_out
    )


def _part_of(usage: Mapping[str, Any], details: str, name: str, whole: int) -> bool:
    given = usage.get(details)
    if given is None:
        return True
    if type(given) is not dict:
        return False
    part = given.get(name)
    return part is None or (type(part) is int and 0 <= part <= whole)


def answer_texts(answer: Mapping[str, Any]) -> list[str]:
    """The generated texts of a whole response: message text, refusals, function arguments."""
    texts: list[str] = []
    for item in answer.get("output") or ():
        if not isinstance(item, dict):
            continue
        if item.get("type") == "function_call":
            texts += [item.get("name") or "", item.get("arguments") or ""]
        for part in item.get("content") or ():
            if isinstance(part, dict):
                texts.append(part.get("text") or part.get("refusal") or "")
    return [text for text in texts if isinstance(text, str)]


def add_system(body: dict[str, Any], system_prompt: str) -> bool:
    """Put the tenant's system prompt first in `instructions`; True if the body changed."""
    given = body.get("instructions")
    if isinstance(given, str) and given.startswith(system_prompt):
        return False
    body["instructions"] = system_prompt if not given else f"{system_prompt}\n\n{given}"
    return True


def _read_usage(event: dict[str, Any], parts: dict[str, Any]) -> dict[str, Any] | None:
    response = event.get("response")
    if not isinstance(response, dict):
        return None
    # The id the backend stores the response under; none where it says it did not store it
    # (vLLM with its store off answers `store: false`): nothing to remember of whose it is.
    parts[ANSWER_ID] = None if response.get("store") is False else response.get("id")
    usage = response.get("usage")
    return usage if isinstance(usage, dict) else None


_ENDINGS = r"response\.completed|response\.incomplete|response\.failed"
EVENTS = StreamEvents(
    delta=type_pattern(
        r"response\.(?:output_text|refusal|function_call_arguments|reasoning_text"
        r"|reasoning_summary_text)\.delta"
    ),
    text=text_pattern("delta"),
    opens=type_pattern(r"response\.output_item\.added"),
    call=type_pattern("function_call|custom_tool_call|mcp_call"),
    usage=type_pattern(_ENDINGS + "|error"),
    completes=type_pattern(_ENDINGS),
    last=type_pattern(_ENDINGS),
    read_usage=_read_usage,
    failures=frozenset({"error", "response.failed"}),
)
