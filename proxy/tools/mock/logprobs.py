"""Fake but consistent log-probabilities for the mock's chat and text completions, in OpenAI's
shapes: chat's `logprobs.content` entries, completions' `tokens`, `token_logprobs`,
`top_logprobs` and `text_offset`; whole, or one token's a stream event (ScoredFormat).

Token i's logprob is a pure function of the answer and i. The sampled token leads its top
alternatives; each alternative (another word of the mock's vocabulary) is half as likely as the
one before, all of them together less likely than the sampled one is not: every position's
probabilities sum to at most 1, as a model's do.
"""

from __future__ import annotations

import itertools
import math
import zlib
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.tools.mock.text import TokenSource

__all__ = ["Logprobs", "ScoredFormat"]


class Logprobs:
    """The log-probabilities of one answer's first `n_tokens` tokens, `top` alternatives each."""

    __slots__ = ("_offsets", "_tokens", "top")

    def __init__(self, tokens: TokenSource, n_tokens: int, top: int) -> None:
        self._tokens = tokens
        self.top = top
        lengths = (len(tokens.text(i)) for i in range(n_tokens))
        self._offsets = [0, *itertools.accumulate(lengths)]

    def _ranked(self, i: int) -> list[tuple[str, float]]:
        """Token i and its alternatives, most likely first, with their logprobs."""
        text = self._tokens.text(i)
        unit = zlib.crc32(b"%d:" % i + text.encode("utf-8", "surrogatepass")) / 2**32
        sampled = 0.35 + 0.64 * unit  # probability in [0.35, 0.99)
        ranked = [(text, math.log(sampled))]
        for k, other in enumerate(self._tokens.alternatives(i, max(0, self.top - 1)), 1):
            ranked.append((other, math.log((1 - sampled) / 2**k)))
        return ranked

    def chat_entry(self, i: int) -> dict[str, Any]:
        """Token i as chat's `logprobs.content` holds it."""
        ranked = [
            {"token": token, "logprob": logprob, "bytes": list(token.encode())}
            for token, logprob in self._ranked(i)
        ]
        return {**ranked[0], "top_logprobs": ranked[: self.top]}

    def chat(self, start: int, stop: int) -> dict[str, Any]:
        content = [self.chat_entry(i) for i in range(start, stop)]
        return {"content": content, "refusal": None}

    def completion(self, start: int, stop: int) -> dict[str, Any]:
        """Tokens `start` to `stop` as a text completion's `logprobs` holds them."""
        ranked = [self._ranked(i) for i in range(start, stop)]
        return {
            "tokens": [each[0][0] for each in ranked],
            "token_logprobs": [each[0][1] for each in ranked],
            "top_logprobs": [dict(each[: self.top]) for each in ranked],
            "text_offset": self._offsets[start:stop],
        }


@dataclass(frozen=True, slots=True)
class ScoredFormat:
    """A chat or text completion stream whose every token event carries the token's logprobs
    (a StreamFormat): each event is encoded whole, as no two are alike but for one slot.
    `head` goes first (chat's role event), `tail` last (usage, [DONE])."""

    base: dict[str, Any]  # id, object, created, model
    usage: bool  # include_usage: each event has `usage: null` after its choices
    index: int
    chat: bool
    finish_reason: str
    scores: Logprobs
    head: bytes
    tail: bytes

    def encode(self, tokens: TokenSource, start: int, stop: int, last: bool) -> bytes:
        parts = [self.head] if start == 0 else []
        for i in range(start, stop):
            finish = self.finish_reason if last and i == stop - 1 else None
            if self.chat:
                choice = {"index": self.index, "delta": {"content": tokens.text(i)}}
                choice["logprobs"] = self.scores.chat(i, i + 1)
            else:
                choice = {"text": tokens.text(i), "index": self.index}
                choice["logprobs"] = self.scores.completion(i, i + 1)
            chunk = {**self.base, "choices": [{**choice, "finish_reason": finish}]}
            if self.usage:
                chunk["usage"] = None
            parts.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
        if last:
            parts.append(self.tail)
        return b"".join(parts)
