"""Chat formats for tokenizers without a chat template: what the published Hugging Face
templates of Qwen2, Qwen2.5 (ChatML), Llama 3 and Llama 3.1+ render, generation prompt included.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from proxy.tokens.base import ChatRenderer, ChatTemplateError, TokenizerError, Tools

__all__ = ["TEMPLATES", "builtin_template", "chatml", "llama3", "llama31", "qwen2", "qwen25"]

QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
QWEN2_SYSTEM = "You are a helpful assistant."
_TOOLS_HEAD = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments"
    ' within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n</tool_call>'
)
_LLAMA_TOOLS_HEAD = (
    "Given the following functions, please respond with a JSON for a function call with its"
    " proper arguments that best answers the given prompt.\n\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name'
    " and its value}.Do not use variables.\n\n"
)


def tojson(value: object, indent: int | None = None) -> str:
    """JSON as Hugging Face templates' `tojson` writes it: no ASCII escaping, no HTML escaping."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _chatml(messages: list[dict[str, Any]], tools: Tools, system: str | None) -> list[str]:
    """Qwen2.5's format: the system turn (tools listed in it), then each turn; tool results are
    grouped into one user turn of <tool_response> blocks.
    """
    first = messages[0] if messages else {}
    if first.get("role") == "system":
        system, messages = first.get("content", ""), messages[1:]
    out: list[str] = []
    if tools:
        listed = "".join("\n" + tojson(tool) for tool in tools)
        out.append(
            f"<|im_start|>system\n{system or ''}{_TOOLS_HEAD}{listed}{_TOOLS_TAIL}<|im_end|>\n"
        )
    elif system is not None:
        out.append(f"<|im_start|>system\n{system}<|im_end|>\n")
    for index, message in enumerate(messages):
        role, content = message.get("role"), message.get("content", "")
        if role == "tool":
            if index == 0 or messages[index - 1].get("role") != "tool":
                out.append("<|im_start|>user")
            out.append(f"\n<tool_response>\n{content}\n</tool_response>")
            if index == len(messages) - 1 or messages[index + 1].get("role") != "tool":
                out.append("<|im_end|>\n")
        elif role == "assistant" and message.get("tool_calls"):
            out.append("<|im_start|>assistant" + (f"\n{content}" if content else ""))
            for call in message["tool_calls"]:
                function = call.get("function", call) if isinstance(call, Mapping) else {}
                name, arguments = function.get("name"), tojson(function.get("arguments"))
                out.append(
                    f'\n<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'
                )
            out.append("<|im_end|>\n")
        elif role in ("user", "system", "assistant"):
            out.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return out


def qwen25(messages: list[dict[str, Any]], tools: Tools) -> str:
    return "".join(_chatml(messages, tools, QWEN25_SYSTEM))


def chatml(messages: list[dict[str, Any]], tools: Tools) -> str:
    """Plain ChatML: Qwen2.5's format without a default system message."""
    return "".join(_chatml(messages, tools, None))


def qwen2(messages: list[dict[str, Any]], tools: Tools) -> str:
    """Qwen2's template knows no tools: every turn as it is, after the default system turn."""
    out = (
        [] if messages and messages[0].get("role") == "system" else [_turn("system", QWEN2_SYSTEM)]
    )
    out.extend(_turn(str(m.get("role")), str(m.get("content", ""))) for m in messages)
    return "".join(out) + "<|im_start|>assistant\n"


def _turn(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def _header(role: str) -> str:
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n"


def llama3(messages: list[dict[str, Any]], tools: Tools) -> str:
    """Llama 3 (3.0): every turn under a role header, content trimmed; no tools."""
    turns = (
        _header(str(m.get("role"))) + str(m.get("content", "")).strip() + "<|eot_id|>"
        for m in messages
    )
    return "<|begin_of_text|>" + "".join(turns) + _header("assistant")


def llama31(messages: list[dict[str, Any]], tools: Tools, *, date: str | None = None) -> str:
    """Llama 3.1, 3.2 (text) and 3.3: a system turn with knowledge and today's date, tools
    listed in the first user turn, one tool call per assistant turn, tool results as ipython.
    """
    system = ""
    if messages and messages[0].get("role") == "system":
        system, messages = str(messages[0].get("content", "")).strip(), messages[1:]
    today = date or time.strftime("%d %b %Y")
    environment = "Environment: ipython\n" if tools else ""
    out = [_header("system"), environment, "Cutting Knowledge Date: December 2023\n"]
    out.append(f"Today Date: {today}\n\n{system}<|eot_id|>")
    if tools:
        if not messages:
            raise ChatTemplateError("Llama 3.1 puts tools in the first user message; none given")
        listed = "".join(tojson(tool, indent=4) + "\n\n" for tool in tools)
        first = str(messages[0].get("content", "")).strip()
        out.append(_header("user") + _LLAMA_TOOLS_HEAD + listed + first + "<|eot_id|>")
        messages = messages[1:]
    for message in messages:
        out.append(_llama31_turn(message))
    return "<|begin_of_text|>" + "".join(out) + _header("assistant")


def _llama31_turn(message: Mapping[str, Any]) -> str:
    role, content = message.get("role"), message.get("content", "")
    if role in ("tool", "ipython"):
        # The template's `is iterable` test holds for strings too, so results are JSON-quoted.
        return _header("ipython") + tojson(content) + "<|eot_id|>"
    calls = message.get("tool_calls")
    if not calls:
        return _header(str(role)) + str(content).strip() + "<|eot_id|>"
    if len(calls) != 1:
        raise ChatTemplateError("Llama 3.1 supports a single tool call per message")
    call = calls[0].get("function", calls[0]) if isinstance(calls[0], Mapping) else {}
    arguments = tojson(call.get("arguments"))
    return (
        _header("assistant")
        + f'{{"name": "{call.get("name")}", "parameters": {arguments}}}<|eot_id|>'
    )


TEMPLATES: Mapping[str, ChatRenderer] = MappingProxyType(
    {"chatml": chatml, "qwen2": qwen2, "qwen2.5": qwen25, "llama3": llama3, "llama3.1": llama31}
)


def builtin_template(name: str) -> ChatRenderer:
    try:
        return TEMPLATES[name]
    except KeyError:
        known = ", ".join(f"#{key}" for key in TEMPLATES)
        raise TokenizerError(f"unknown chat format #{name}; built in: {known}") from None
