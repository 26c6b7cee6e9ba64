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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import orjson

from proxy.tools.mock.request import MockHTTPError, int_field
from proxy.tools.mock.stream import tail_events
from proxy.tools.mock.text import TokenSource
from proxy.tools.mock.toolplan import ToolPlan, call_id

__all__ = [
    "MAX_TOOL_CALLS",
    "PIECE_CHARS",
    "ToolCallFormat",
    "ToolPlan",
    "call_count",
    "chosen_tool",
    "function_tools",
    "make_plan",
    "tool_plan",
]

PIECE_CHARS: Final = 4  # of a call's arguments a streamed token carries (a model's ~3-4)
MAX_TOOL_CALLS: Final = 16
_MAX_PROPERTIES: Final = 256  # of one schema, made into arguments


def tool_plan(body: dict[str, Any], prompt_text: str) -> ToolPlan | None:
    """The calls a chat request is answered with, None for a text answer."""
    calls = call_count(body)
    functions = function_tools(body.get("tools"), _chat_function, "parameters")
    if not functions:
        return None
    messages = body.get("messages") or [{}]
    asked = messages[-1].get("role") == "user"
    chosen = chosen_tool(body.get("tool_choice"), functions, asked, _chat_choice)
    serial = "'parallel_tool_calls' is false" if body.get("parallel_tool_calls") is False else ""
    return make_plan(functions, chosen, calls, prompt_text, serial=serial)


def _chat_function(tool: dict[str, Any]) -> dict[str, Any] | None:
    function = tool.get("function")
    return function if tool.get("type") == "function" and isinstance(function, dict) else None


def _chat_choice(choice: object) -> str:
    """The name a chat `tool_choice` object gives, checked."""
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise MockHTTPError(
            400, "'tool_choice' must be \"none\", \"auto\", \"required\" or "
            '{"type": "function", "function": {"name": ...}}.', param="tool_choice",
        )  # fmt: skip
    return name


def call_count(body: dict[str, Any]) -> int:
    """The calls a tool-calling answer makes: the knob `mock_tool_calls`, else 1."""
    return int_field(body, "mock_tool_calls", low=1, high=MAX_TOOL_CALLS) or 1


def make_plan(
    functions: dict[str, dict[str, Any]],
    chosen: str | None,
    calls: int,
    prompt_text: str,
    *,
    serial: str,
) -> ToolPlan | None:
    """`calls` calls of `chosen` ("" for any: going round `functions`, name -> JSON schema;
    None for none). `serial` says how the request forbids parallel calls ("" when it does not):
    then more than one is a 400."""
    if chosen is None:
        return None
    if calls > 1 and serial:
        raise MockHTTPError(
            400, f"'mock_tool_calls' > 1 asks for parallel calls; {serial}.",
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


def function_tools(
    tools: object, definition: Callable[[dict[str, Any]], dict[str, Any] | None], schema_key: str
) -> dict[str, dict[str, Any]]:
    """The request's tools the mock may call, by name, each with its JSON schema: `definition`
    finds a tool's name and schema (at `schema_key`) in it, None for a tool never called."""
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise MockHTTPError(400, "'tools' must be an array.", param="tools")
    functions: dict[str, dict[str, Any]] = {}
    for tool in tools:
        if not isinstance(tool, dict):
            raise MockHTTPError(400, "Each tool must be an object.", param="tools")
        function = definition(tool)
        if function is None:
            continue  # a custom or hosted tool: the mock calls functions only
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise MockHTTPError(400, "A function tool needs a 'name'.", param="tools")
        schema = function.get(schema_key)
        functions[name] = schema if isinstance(schema, dict) else {}
    return functions


def chosen_tool(
    choice: object,
    functions: dict[str, dict[str, Any]],
    asked: bool,
    name_of: Callable[[object], str],
) -> str | None:
    """The tool `tool_choice` ("none", "auto" or None, "required", or an object `name_of` reads
    a name from) picks: "" for any, None for no call. "auto" calls when the user `asked`."""
    if choice == "none":
        return None
    if choice == "required":
        return ""
    if choice == "auto" or choice is None:
        return "" if asked else None
    name = name_of(choice)
    if name not in functions:
        raise MockHTTPError(
            400, f"'tool_choice' names {name!r}, which is not among 'tools'.", param="tool_choice"
        )
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
    finish: bytes  # the finish event
    tail: bytes  # usage (when asked) and [DONE]

    @classmethod
    def build(
        cls,
        base: dict[str, Any],
        plan: ToolPlan,
        finish_reason: str,
        usage: dict[str, int] | None,
        choice: int = 0,
    ) -> ToolCallFormat:
        """`choice` is the choice's index."""
        extra: dict[str, Any] = {} if usage is None else {"usage": None}

        def event(delta: dict[str, Any], finish: str | None = None) -> bytes:
            at = {"index": choice, "delta": delta, "logprobs": None, "finish_reason": finish}
            return b"data: " + orjson.dumps({**base, "choices": [at], **extra}) + b"\n\n"

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
        finish = event({}, finish_reason)
        return cls(
            tuple(opening), tuple(prefixes), suffix, pieces, finish, tail_events(base, usage)
        )

    def encode(self, tokens: TokenSource, start: int, stop: int, last: bool) -> bytes:
        parts: list[bytes] = []
        for i in range(start, stop):
            index, piece = self.pieces[i]
            if i == 0 or self.pieces[i - 1][0] != index:
                parts.append(self.opening[index])
            parts += (self.prefixes[index], piece, self.suffix)
        if last:
            parts += (self.finish, self.tail)
        return b"".join(parts)
