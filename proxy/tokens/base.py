"""The token-counting contract: the `TokenCounter` protocol, its errors, and the rules every
adapter shares (content parts from proxy/tokens/parts.py, completion prompts).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeAlias

from proxy.tokens.parts import MEDIA_TOKENS, MEDIA_TOKENS_LOW, media_tokens, split_content

__all__ = [
    "MEDIA_TOKENS",
    "MEDIA_TOKENS_LOW",
    "ChatRenderer",
    "ChatTemplateError",
    "CountText",
    "EncodedCounter",
    "Messages",
    "Prompt",
    "TokenCounter",
    "TokenizerError",
    "Tools",
    "chat_chars",
    "media_tokens",
    "prompt_chars",
    "prompt_count",
    "prompt_tokens",
    "prompts_of",
    "split_content",
]

Messages: TypeAlias = Sequence[Mapping[str, Any]]
Tools: TypeAlias = Sequence[Mapping[str, Any]] | None
Prompt: TypeAlias = str | list[str] | list[int] | list[list[int]]
# Tokens in a text, special tokens recognised as the adapter decides.
CountText: TypeAlias = Callable[[str], int]
# Renders normalised messages (string content, parsed tool-call arguments) to prompt text.
ChatRenderer: TypeAlias = Callable[[list[dict[str, Any]], Tools], str]


class TokenizerError(Exception):
    """A tokenizer that cannot be loaded (bad spec, missing file, missing extra)."""


class ChatTemplateError(TokenizerError):
    """The model's chat template rejected the conversation (the backend would reject it too)."""


class TokenCounter(Protocol):
    """Counts what a backend reports as `usage.prompt_tokens`, before the request is sent."""

    name: str
    exact: bool

    def count_text(self, text: str) -> int:
        """Tokens of `text` alone: nothing added (no BOS, no chat format); special-token strings
        in it count as the backend counts them (one token each for open-weights models).
        """
        ...

    def count_chat(self, messages: Messages, tools: Tools = None) -> int:
        """Prompt tokens of a chat request: content plus the chat format's overhead."""
        ...

    def count_prompt(self, prompt: Prompt) -> int:
        """Prompt tokens of a /v1/completions request (text, texts, token ids or id lists)."""
        ...


def chat_chars(messages: Messages, tools: Tools = None) -> int:
    """A cheap size of a chat request in characters, to decide where to count it."""
    total = 0
    for message in messages:
        for key, value in message.items():
            if isinstance(value, str):
                total += len(value)
            elif key == "content":
                total += sum(len(text) for text in split_content(value)[0])
            elif value is not None:
                total += len(repr(value))
    for tool in tools or ():
        total += len(repr(tool))
    return total


def prompt_chars(prompt: Prompt) -> int:
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(item) if isinstance(item, str | list) else 1 for item in prompt)


def prompts_of(prompt: object) -> list[Any]:
    """The prompts a completions `prompt` (or embeddings `input`) holds: one text or one list
    of token ids, or each text or id list of a batch."""
    if type(prompt) is list and prompt and type(prompt[0]) is not int:
        return prompt
    return [prompt]


def prompt_count(prompt: object) -> int:
    return len(prompts_of(prompt))


def prompt_tokens(prompt: Prompt, count_text: Callable[[str], int], added_per_text: int) -> int:
    """Tokens of a completions prompt: texts are tokenized (plus the tokens the backend adds to
    each, e.g. Llama's BOS); token ids are already tokens and are counted as given.
    """
    if isinstance(prompt, str):
        return count_text(prompt) + added_per_text
    total = 0
    for item in prompt:
        if isinstance(item, str):
            total += count_text(item) + added_per_text
        elif isinstance(item, list):
            total += len(item)
        else:
            total += 1
    return total


class EncodedCounter:
    """What every exact counter shares: its tokenizer for text and prompts. Subclasses say how
    a chat is counted (a rendered template, or OpenAI's rule)."""

    __slots__ = ("_added_per_text", "_encode", "chat_format", "exact", "name")

    def __init__(
        self, name: str, encode: CountText, *, chat_format: str, added_per_text: int = 0
    ) -> None:
        self.name = name
        self.exact = True
        self.chat_format = chat_format
        self._encode = encode
        self._added_per_text = added_per_text

    def count_text(self, text: str) -> int:
        return self._encode(text)

    def count_prompt(self, prompt: Prompt) -> int:
        return prompt_tokens(prompt, self._encode, self._added_per_text)
