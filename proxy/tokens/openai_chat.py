"""OpenAI's published rule for a chat request's prompt tokens, from the cookbook "How to count
tokens with tiktoken": 3 tokens per message, 1 per name, 3 to prime the reply; tools by the
cookbook's per-function/property/enum constants (approximate: OpenAI's tool format is private).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.tokens.base import CountText, EncodedCounter, Messages, Tools, split_content

__all__ = ["GPT4O_RULE", "GPT4_RULE", "OpenAIChatRule", "RuleCounter"]


@dataclass(frozen=True, slots=True)
class OpenAIChatRule:
    """The cookbook's constants; only the per-function cost differs between model families."""

    func_init: int
    tokens_per_message: int = 3
    tokens_per_name: int = 1
    reply_priming: int = 3
    prop_init: int = 3
    prop_key: int = 3
    enum_init: int = -3
    enum_item: int = 3
    func_end: int = 12

    def count(self, messages: Messages, tools: Tools, count_text: CountText) -> int:
        total = self.reply_priming
        for message in messages:
            total += self.tokens_per_message + self._message(message, count_text)
        if tools:
            total += self.func_end + sum(self._tool_or_floor(tool, count_text) for tool in tools)
        return total

    def _tool_or_floor(self, tool: Mapping[str, Any], count_text: CountText) -> int:
        """The rule renders a schema's names, types, descriptions and enums only: text in any
        other key (`examples`, `default`, `$defs`, ...) would pass uncounted, though a backend
        may put it in the prompt: a tool costs at least its JSON's length over
        _MOST_CHARS_PER_TOKEN."""
        return max(self._tool(tool, count_text), len(_json(tool)) // _MOST_CHARS_PER_TOKEN)

    def _message(self, message: Mapping[str, Any], count_text: CountText) -> int:
        total = 0
        for key, value in message.items():
            if key == "content":
                texts, media = split_content(value)
                total += media + sum(count_text(text) for text in texts)
            elif key == "tool_calls" and isinstance(value, Sequence):
                total += sum(_tool_call(call, count_text) for call in value)
            elif isinstance(value, str):
                total += count_text(value)
            elif value is not None:
                total += count_text(_json(value))
            if key == "name":
                total += self.tokens_per_name
        return total

    def _tool(self, tool: Mapping[str, Any], count_text: CountText) -> int:
        function = tool.get("function")
        if not isinstance(function, Mapping):
            return self.func_init + count_text(_json(tool))
        line = f"{function.get('name', '')}:{_sentence(function.get('description'))}"
        total = self.func_init + count_text(line)
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
        if isinstance(properties, Mapping) and properties:
            total += self.prop_init
            for name, schema in properties.items():
                total += self.prop_key + self._property(str(name), schema, count_text)
        return total

    def _property(self, name: str, schema: object, count_text: CountText) -> int:
        if not isinstance(schema, Mapping):
            return count_text(name)
        kind = schema.get("type", "")
        kind = "|".join(map(str, kind)) if isinstance(kind, list) else str(kind)
        total = count_text(f"{name}:{kind}:{_sentence(schema.get('description'))}")
        enum = schema.get("enum")
        if isinstance(enum, list):
            total += self.enum_init
            total += sum(self.enum_item + count_text(str(item)) for item in enum)
        for nested in ("items", "properties", "anyOf", "oneOf"):
            if nested in schema:
                # Beyond the cookbook, which covers flat schemas: nested ones as their JSON.
                total += count_text(_json(schema[nested]))
        return total


def _tool_call(call: object, count_text: CountText) -> int:
    """An assistant's earlier tool call: its name and arguments (approximate)."""
    if not isinstance(call, Mapping):
        return count_text(_json(call))
    function = call.get("function")
    if not isinstance(function, Mapping):
        return count_text(_json(call))
    arguments = function.get("arguments", "")
    arguments = arguments if isinstance(arguments, str) else _json(arguments)
    return count_text(str(function.get("name", ""))) + count_text(arguments)


def _sentence(text: object) -> str:
    """The cookbook drops a description's final period."""
    text = "" if text is None else str(text)
    return text[:-1] if text.endswith(".") else text


def _json(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


# A tool's JSON is 3-4 characters a token in OpenAI's encodings: at 12, the floor counts at
# least a quarter of any text hidden in a tool, and stays below the rule for ordinary schemas.
_MOST_CHARS_PER_TOKEN = 12


GPT4O_RULE = OpenAIChatRule(func_init=7)  # gpt-4o, gpt-4o-mini and later (o200k_base)
GPT4_RULE = OpenAIChatRule(func_init=10)  # gpt-3.5-turbo, gpt-4 (cl100k_base)


class RuleCounter(EncodedCounter):
    """A tokenizer with OpenAI's chat rule: OpenAI encodings, and the generic chat format of
    a Hugging Face tokenizer that has no chat template.
    """

    __slots__ = ("_rule",)

    def __init__(
        self,
        name: str,
        encode: CountText,
        rule: OpenAIChatRule,
        *,
        chat_format: str = "openai",
        added_per_text: int = 0,
    ) -> None:
        super().__init__(name, encode, chat_format=chat_format, added_per_text=added_per_text)
        self._rule = rule

    def count_chat(self, messages: Messages, tools: Tools = None) -> int:
        return self._rule.count(messages, tools, self._encode)
