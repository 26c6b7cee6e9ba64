"""The tool calls one mock answer makes (built by toolcalls.py, carried by its request)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

__all__ = ["ToolPlan", "call_id"]


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """The calls one answer makes: names, and their arguments cut into one-token pieces."""

    names: tuple[str, ...]
    pieces: tuple[tuple[int, str], ...]  # (the call's index, a piece of its arguments)

    def arguments(self, n_tokens: int) -> list[str]:
        """Each call's arguments as far as the first `n_tokens` pieces go (begun calls only)."""
        texts: list[str] = []
        for index, piece in self.pieces[:n_tokens]:
            if index == len(texts):
                texts.append("")
            texts[index] += piece
        return texts

    def message(self, n_tokens: int) -> dict[str, Any]:
        """The whole answer's assistant message, with new call ids."""
        calls = [
            {"id": call_id(), "type": "function", "function": {"name": name, "arguments": text}}
            for name, text in zip(self.names, self.arguments(n_tokens), strict=False)
        ]
        return {"role": "assistant", "content": None, "tool_calls": calls}


def call_id() -> str:
    """A new call id, as OpenAI writes them."""
    return "call_" + uuid.uuid4().hex[:24]
