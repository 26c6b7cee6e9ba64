"""The mock backend's tool calls: a chat request with function tools is answered with a call,
as a model makes one, so an agent loop or a gateway's tool handling can be run without a GPU.

When it calls (OpenAI's `tool_choice`): `"none"` never; `"required"` or a named function
always; `"auto"` (the default) when the newest message is the user's (a question to act on),
not after the tools' results (then it answers in text, as an agent loop expects). It calls the
named function, else the first function tool; the knob `mock_tool_calls: N` makes N parallel
calls, going round the function tools (a 400 where `parallel_tool_calls` is false).

Arguments are made from the function's JSON schema, top-level `properties` only: a `const` or the
first of an `enum` as given, else by `type` a word of the answer's pseudo-text (string), a number,
`true`, `[]`, `{}` or null. They are streamed OpenAI's way (vLLM's too): one event opening each
call (`index`, `id`, `type`, the name, empty arguments), then the arguments in pieces of
PIECE_CHARS characters, one token each, and an empty delta with `finish_reason: "tool_calls"`.
`max_tokens` cuts the pieces (`"length"`, arguments left unfinished), as it cuts a model's.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Final

import orjson

from proxy.tools.mock.request import MockHTTPError, int_field
from proxy.tools.mock.stream import tail_events
from proxy.tools.mock.text import TokenSource
from proxy.tools.mock.toolplan import ToolPlan, call_id

__all__ = ["MAX_TOOL_CALLS", "PIECE_CHARS", "ToolCallFormat", "ToolPlan", "tool_plan"]

PIECE_CHARS: Final = 4  # of a call's arguments a streamed token carries (a model's ~3-4)
MAX_TOOL_CALLS: Final = 16
_MAX_PROPERTIES: Final = 256  # of one schema, made into arguments


def tool_plan(body: dict[str, Any], prompt_text: str) -> ToolPlan | None:
    """The calls a chat request is answered with, None for a text answer."""
    calls = int_field(body, "mock_tool_calls", low=1, high=MAX_TOOL_CALLS) or 1
    functions = _function_tools(body.get("tools"))
    if not functions:
        return None
    chosen = _chosen(body, functions)
    if chosen is None:
        return None
    if calls > 1 and body.get("parallel_tool_calls") is False:
        raise MockHTTPError(
            400, "'mock_tool_calls' > 1 asks for parallel calls; 'parallel_tool_calls' is false.",
            param="mock_tool_calls",
        )  # fmt: skip
    order = [chosen] if chosen in functions else list(functions)
    names = tuple(order[i % len(order)] for i in range(calls))
    words = TokenSource(prompt_text)
    pieces: list[tuple[int, str]] = []
    for index, name in enumerate(names):
        text = orjson.dumps(_arguments(functions[name], words, index)).decode()
        pieces += [(index, text[at : at + PIECE_CHARS]) for at in range(0, len(text), PIECE_CHARS)]
    return ToolPlan(names, tuple(pieces))


def _function_tools(tools: object) -> dict[str, dict[str, Any]]:
    """The request's function tools by name, each with its parameters' schema."""
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise MockHTTPError(400, "'tools' must be an array.", param="tools")
    functions: dict[str, dict[str, Any]] = {}
    for tool in tools:
        if not isinstance(tool, dict):
            raise MockHTTPError(400, "Each tool must be an object.", param="tools")
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            continue  # a custom or hosted tool: the mock calls functions only
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise MockHTTPError(400, "A function tool needs a 'name'.", param="tools")
        schema = function.get("parameters")
        functions[name] = schema if isinstance(schema, dict) else {}
    return functions


def _chosen(body: dict[str, Any], functions: dict[str, dict[str, Any]]) -> str | None:
    """The function named by `tool_choice`, "" for any, None for no call."""
    choice = body.get("tool_choice", "auto")
    if choice == "none":
        return None
    if choice == "required":
        return ""
    if choice == "auto" or choice is None:
        messages = body.get("messages") or [{}]
        return "" if messages[-1].get("role") == "user" else None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise MockHTTPError(
            400, "'tool_choice' must be \"none\", \"auto\", \"required\" or "
            '{"type": "function", "function": {"name": ...}}.', param="tool_choice",
        )  # fmt: skip
    if name not in functions:
        raise MockHTTPError(
            400, f"'tool_choice' names the function {name!r}, which is not among 'tools'.",
            param="tool_choice",
        )  # fmt: skip
    return name


def _arguments(schema: dict[str, Any], words: TokenSource, call: int) -> dict[str, Any]:
    properties = schema.get("properties")
    if not isinstance(properties, dict):
        return {}
    arguments: dict[str, Any] = {}
    for i, (name, spec) in enumerate(list(properties.items())[:_MAX_PROPERTIES]):
        arguments[name] = _value(spec if isinstance(spec, dict) else {}, words, call * 64 + i)
    return arguments


def _value(spec: dict[str, Any], words: TokenSource, i: int) -> object:
    if "const" in spec:
        return spec["const"]
    enum = spec.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    kind = spec.get("type")
    if isinstance(kind, list):  # ["string", "null"]: the first
        kind = kind[0] if kind else None
    if kind == "integer":
        return zlib.crc32(words.text(i).encode()) % 100
    if kind == "number":
        return zlib.crc32(words.text(i).encode()) % 1000 / 10
    values = {"boolean": True, "array": [], "object": {}, "null": None}
    return values[kind] if kind in values else words.text(i).strip()


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """One tool-call stream's pre-encoded events (a StreamFormat): token i is piece i."""

    opening: tuple[bytes, ...]  # per call: the event naming it (the first with the role)
    prefixes: tuple[bytes, ...]  # per call: an arguments event up to the piece's JSON string
    suffix: bytes
    pieces: tuple[tuple[int, bytes], ...]  # (call index, the piece as a JSON string)
    ending: bytes  # the finish event, usage (when asked) and [DONE]

    @classmethod
    def build(
        cls, base: dict[str, Any], plan: ToolPlan, finish_reason: str, usage: dict[str, int] | None
    ) -> ToolCallFormat:
        extra: dict[str, Any] = {} if usage is None else {"usage": None}

        def event(delta: dict[str, Any], finish: str | None = None) -> bytes:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return b"data: " + orjson.dumps({**base, "choices": [choice], **extra}) + b"\n\n"

        opening, prefixes = [], []
        for index, name in enumerate(plan.names):
            function = {"name": name, "arguments": ""}
            call = {"index": index, "id": call_id(), "type": "function", "function": function}
            role = {"role": "assistant", "content": None} if index == 0 else {}
            opening.append(event({**role, "tool_calls": [call]}))
            marked = event({"tool_calls": [{"index": index, "function": {"arguments": "\0"}}]})
            prefix, suffix = marked.split(b'"\\u0000"')
            prefixes.append(prefix)
        pieces = tuple((index, orjson.dumps(piece)) for index, piece in plan.pieces)
        ending = event({}, finish_reason) + tail_events(base, usage)
        return cls(tuple(opening), tuple(prefixes), suffix, pieces, ending)

    def encode(self, tokens: TokenSource, start: int, stop: int, last: bool) -> bytes:
        parts: list[bytes] = []
        for i in range(start, stop):
            index, piece = self.pieces[i]
            if i == 0 or self.pieces[i - 1][0] != index:
                parts.append(self.opening[index])
            parts += (self.prefixes[index], piece, self.suffix)
        if last:
            parts.append(self.ending)
        return b"".join(parts)
