"""Counting a chat as an open-weights backend (vLLM) does: render the model's chat template
with the generation prompt, then tokenize the rendering with special tokens recognised.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from proxy.tokens.base import (
    ChatRenderer,
    CountText,
    EncodedCounter,
    Messages,
    Tools,
    split_content,
)

__all__ = ["TemplatedCounter", "normalise_messages"]


def normalise_messages(messages: Messages) -> tuple[list[dict[str, Any]], int]:
    """Messages as vLLM hands them to a template, and the estimated tokens of their media.

    Content parts become one string (text parts joined by newlines, media dropped and counted
    at the fixed estimate); None becomes ""; tool-call arguments are parsed from their JSON.
    """
    normalised: list[dict[str, Any]] = []
    media = 0
    for message in messages:
        item = dict(message)
        texts, message_media = split_content(message.get("content"))
        media += message_media
        item["content"] = "\n".join(texts)
        calls = item.get("tool_calls")
        if isinstance(calls, list):
            item["tool_calls"] = [_parse_arguments(call) for call in calls]
        normalised.append(item)
    return normalised, media


def _parse_arguments(call: object) -> object:
    if not isinstance(call, Mapping):
        return call
    function = call.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


class TemplatedCounter(EncodedCounter):
    """A tokenizer plus a chat format: exact for text, exact for chats the format describes."""

    __slots__ = ("_render",)

    def __init__(
        self,
        name: str,
        encode: CountText,
        render: ChatRenderer,
        *,
        chat_format: str,
        added_per_text: int = 0,
    ) -> None:
        super().__init__(name, encode, chat_format=chat_format, added_per_text=added_per_text)
        self._render = render

    def count_chat(self, messages: Messages, tools: Tools = None) -> int:
        normalised, media = normalise_messages(messages)
        return self._encode(self.render(normalised, tools)) + media

    def render(self, messages: list[dict[str, Any]], tools: Tools = None) -> str:
        """The prompt text the backend will tokenize (messages already normalised)."""
        return self._render(messages, list(tools) if tools else None)
