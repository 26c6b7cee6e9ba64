"""Deterministic content for the mock backend: pseudo-text tokens, prompt counts, embeddings.

Everything here is a pure function of its input, so the same request always gets the same answer.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import struct
import zlib
from collections.abc import Sequence
from typing import Final

import orjson

__all__ = ["TokenSource", "count_words", "embedding_bytes", "embedding_floats", "stopped"]

_WORDS: Final = (
    "the", "river", "quiet", "light", "of", "morning", "falls", "across", "a", "field",
    "where", "old", "stones", "remember", "every", "season", "and", "wind", "carries", "small",
    "songs", "from", "one", "valley", "to", "another", "while", "clouds", "drift", "slowly",
    "over", "hills", "that", "hold", "their", "shape", "through", "rain", "snow", "time",
    "in", "evening", "lamps", "glow", "behind", "windows", "people", "talk", "about", "work",
    "bread", "letters", "journeys", "they", "might", "take", "soon", "but", "night", "comes",
    "gently", "stars", "appear", "above", "roofs", "trees", "birds", "settle", "into", "sleep",
    "until", "sun", "returns", "with", "warm", "colours", "gold", "green", "blue", "silver",
    "paths", "meadows", "between", "gardens", "full", "bright", "flowers", "bees", "visit", "each",
    "harbour", "nothing", "hurries", "here", "world", "keeps", "turning", "as", "it", "should",
)  # fmt: skip

# Per word, pre-encoded as a JSON string: with a leading space (a mid-sentence token) and
# capitalised without one (the first token of an answer).
_SPACED_JSON: Final = tuple(orjson.dumps(" " + word) for word in _WORDS)
_FIRST_JSON: Final = tuple(orjson.dumps(word.capitalize()) for word in _WORDS)
_MASK32: Final = 0xFFFFFFFF


class TokenSource:
    """The pseudo-text answer to one prompt: token `i` is one word, chosen by hashing (seed, i)."""

    __slots__ = ("_seed",)

    def __init__(self, prompt_text: str) -> None:
        self._seed = zlib.crc32(prompt_text.encode("utf-8", "surrogatepass"))

    def _index(self, i: int) -> int:
        # murmur3's 32-bit finaliser over (seed xor i * golden ratio): no two prompts' answers
        # are shifted copies of each other.
        x = self._seed ^ (i * 0x9E3779B1 & _MASK32)
        x = (x ^ (x >> 16)) * 0x85EBCA6B & _MASK32
        x = (x ^ (x >> 13)) * 0xC2B2AE35 & _MASK32
        return (x ^ (x >> 16)) % len(_WORDS)

    def json(self, i: int) -> bytes:
        """Token `i` as a JSON string literal, ready to drop into a pre-encoded chunk."""
        return _SPACED_JSON[self._index(i)] if i else _FIRST_JSON[self._index(0)]

    def text(self, i: int) -> str:
        word = _WORDS[self._index(i)]
        return " " + word if i else word.capitalize()

    def completion(self, n_tokens: int) -> str:
        return "".join(self.text(i) for i in range(n_tokens))

    def alternatives(self, i: int, count: int) -> list[str]:
        """`count` (at most 99) other words token `i` might have been, never its own, each as
        token `i` would read."""
        at = self._index(i)
        words = (_WORDS[(at + 37 * k) % len(_WORDS)] for k in range(1, count + 1))
        return [" " + word if i else word.capitalize() for word in words]


class _CutTokens(TokenSource):
    """An answer cut where a stop sequence began: token `cut` keeps the text before it, and the
    tokens after it (up to the one that completed the sequence) carry none."""

    __slots__ = ("_cut", "_partial")

    def __init__(self, prompt_text: str, cut: int, partial: str) -> None:
        super().__init__(prompt_text)
        self._cut = cut
        self._partial = partial

    def json(self, i: int) -> bytes:
        return super().json(i) if i < self._cut else orjson.dumps(self.text(i))

    def text(self, i: int) -> str:
        if i < self._cut:
            return super().text(i)
        return self._partial if i == self._cut else ""


def stopped(
    prompt_text: str, n_tokens: int, stops: Sequence[str]
) -> tuple[TokenSource, int] | None:
    """The answer as the first stop sequence ends it, and how many tokens it took; None if no
    sequence occurs in its `n_tokens`. As vLLM does: generation ends with the token that
    completes the sequence (it is counted), and the text ends where the sequence began."""
    tokens = TokenSource(prompt_text)
    texts = [tokens.text(i) for i in range(n_tokens)]
    ends = list(itertools.accumulate(map(len, texts)))
    text = "".join(texts)
    starts = [(at + len(stop), at) for stop in stops if (at := text.find(stop)) >= 0]
    if not starts:
        return None
    end, start = min(starts)  # the sequence completed first
    last = bisect.bisect_left(ends, end)  # the token holding its last character
    cut = bisect.bisect_right(ends, start)  # the token it begins in
    partial = tokens.text(cut)[: start - (ends[cut - 1] if cut else 0)]
    return _CutTokens(prompt_text, cut, partial), last + 1


def count_words(text: str) -> int:
    """The mock's own token count for a text: its whitespace-separated words."""
    return len(text.split())


def embedding_bytes(key: bytes, dimensions: int) -> bytes:
    """A unit-length vector derived from `key`, as little-endian float32 (OpenAI's base64 layout).

    Shorter vectors are renormalised prefixes of longer ones, like OpenAI's `dimensions`.
    """
    raw = hashlib.shake_256(key).digest(2 * dimensions)
    ints = struct.unpack(f"<{dimensions}h", raw)
    norm = math.sqrt(math.fsum(v * v for v in ints)) or 1.0
    return struct.pack(f"<{dimensions}f", *(v / norm for v in ints))


def embedding_floats(packed: bytes) -> Sequence[float]:
    """The float32 values of `embedding_bytes`, so both encodings carry identical numbers."""
    return struct.unpack(f"<{len(packed) // 4}f", packed)
