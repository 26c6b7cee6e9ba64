"""A stored answer in one shape for streams and whole responses, built from either, kept compact.

Only complete answers are ever built: a stream without a finish reason and `[DONE]` is not one,
nor an answer the backend says it cut short (`UNFINISHED`).
A whole response's answer comes from `from_response`; a stream's is folded in as its chunks
pass (proxy/cache/fold.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.upstream.exactints import as_written

__all__ = ["UNFINISHED", "Answer", "from_response"]

# Finish reasons of an answer cut short by something other than the request itself: the engine
# aborted it (vLLM's and SGLang's `abort`, as when vLLM's generation is paused to swap weights),
# failed it (vLLM's and Mistral's `error`), or a content filter cut it. Asked again, the backend
# may well answer in full: such an answer is relayed and never stored.
UNFINISHED = frozenset({"abort", "error", "content_filter"})


@dataclass(slots=True)
class Answer:
    """`message` is the chat message (role, content, tool_calls...); `text` a completion's text."""

    operation: str
    model: str
    finish_reason: str
    usage: dict[str, Any]
    message: dict[str, Any] | None = None
    text: str | None = None
    system_fingerprint: str | None = None
    expires_wall: float = 0.0
    # The bytes it was decoded from, where its integers past 64 bits are as the backend wrote
    # them (read here as floats): a replay writes them from there. Not itself stored.
    stored: bytes = field(default=b"", compare=False, repr=False)

    @property
    def prompt_tokens(self) -> int:
        value = self.usage.get("prompt_tokens")
        return value if isinstance(value, int) else 0

    @property
    def completion_tokens(self) -> int:
        value = self.usage.get("completion_tokens")
        return value if isinstance(value, int) else 0

    def expiring(self, wall: float) -> Answer:
        """This answer, kept until `wall` (epoch seconds); dataclasses.replace, without its
        look at every field each call (every stored answer comes through here)."""
        return Answer(
            self.operation, self.model, self.finish_reason, self.usage, self.message, self.text,
            self.system_fingerprint, wall,
        )  # fmt: skip

    def encode(self, source: bytes = b"") -> bytes:
        """The stored bytes, each integer past 64 bits as `source` (the backend's answer, or a
        stream's last bytes) wrote it; orjson.JSONEncodeError if a replay could not write the
        answer.

        orjson writes 254 levels (it reads 1,024), and a replay puts the message two levels
        deeper than this list does: written inside two more lists (then cut off, as the bytes
        are the same), an answer that encodes is one that replays."""
        fields = [
            self.operation, self.model, self.finish_reason, self.usage, self.message, self.text,
            self.system_fingerprint, self.expires_wall,
        ]  # fmt: skip
        return as_written(orjson.dumps([[fields]])[2:-2], fields, source)

    @classmethod
    def decode(cls, raw: bytes) -> Answer:
        answer = cls(*orjson.loads(raw))
        answer.stored = raw
        return answer


def from_response(operation: str, body: dict[str, Any], usage: dict[str, Any]) -> Answer | None:
    """The answer in a whole (non-stream) response body, parsed, or None if it is not a plain
    answer."""
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    finish = choice.get("finish_reason")
    if not isinstance(finish, str) or finish in UNFINISHED:
        return None
    message = choice.get("message") if operation == "chat" else None
    text = choice.get("text") if operation == "text_completion" else None
    if not isinstance(message, dict) and not isinstance(text, str):
        return None
    if message is not None and not _replayable(message):
        return None
    fingerprint = body.get("system_fingerprint")
    return Answer(
        operation, str(body.get("model", "")), finish, usage, message, text,
        fingerprint if isinstance(fingerprint, str) else None,
    )  # fmt: skip


# A message's fields a stream replay carries (proxy/cache/replay.py), as the stream fold keeps
# only these (proxy/cache/fold.py).
_TEXTS = ("content", "reasoning_content", "reasoning", "refusal")
_TEXT_TYPES = (str, type(None))
_REPLAYED = frozenset({"role", "tool_calls", *_TEXTS})
_EMPTY: tuple[Any, ...] = (None, [], {})


def _replayable(message: dict[str, Any]) -> bool:
    """True when a stream replay would carry all of `message` (a whole answer may be asked for
    again as a stream): its texts strings (a replay sends only those: content as a list of
    parts, as Mistral's reasoning models answer, came back as an empty stream), any other field
    empty (OpenAI sends `"audio": null`, `"annotations": []`), and tool calls a list of
    objects."""
    for name in _TEXTS:
        if not isinstance(message.get(name), _TEXT_TYPES):
            return False
    calls = message.get("tool_calls")
    if calls not in _EMPTY and not (
        isinstance(calls, list) and all(isinstance(call, dict) for call in calls)
    ):
        return False
    return all(value in _EMPTY for name, value in message.items() if name not in _REPLAYED)
