"""Token counts of the pieces of a chat remembered per tenant, so a system prompt or a
conversation's history sent again is not tokenized again.

tiktoken encodes a text with special tokens recognised by cutting it at each special token and
encoding the pieces between on their own; so a text's count is its special tokens plus its
pieces' counts, and a piece seen before (a system prompt rendered between the same special
tokens, an earlier turn) can be counted from memory, exactly. Counting a 1,800-token system
prompt costs about 270 µs of CPU; looking it up costs its hash.

The memory is keyed by tenant as well as text: a tenant whose request came back faster because
another tenant had sent the same text would learn that it had (a timing side channel). Which
tenant is counting comes from `counting_for`: the pipeline sets it for the rest of a request
once auth has named the tenant (a ContextVar, so `asyncio.to_thread` carries it to a long
prompt's count); with no tenant set nothing is remembered.
"""

from __future__ import annotations

import re
import threading
import unicodedata
from collections.abc import Callable, Iterable
from contextvars import ContextVar, Token

__all__ = ["SegmentMemory", "counting_for", "counting_tenant", "done_counting", "remembered"]

MAX_CHARS = 4_000_000
"""The remembered pieces' characters in a memory (one a tokenizer), every tenant together, each
piece charged ENTRY_CHARS more for its entry: about 4-5 MB of ASCII text when full."""
ENTRY_CHARS = 128

_tenant: ContextVar[str | None] = ContextVar("tokenweir_counting_for", default=None)


def counting_for(tenant: str | None) -> Token[str | None]:
    """Counts made from now on in this task (and the threads it hands counts to) are `tenant`'s,
    until `done_counting` with what this returned."""
    return _tenant.set(tenant)


def done_counting(token: Token[str | None]) -> None:
    _tenant.reset(token)


def counting_tenant() -> str | None:
    """The tenant whose counts this task makes (None outside a request)."""
    return _tenant.get()


class SegmentMemory:
    """The counts of pieces of text, by (tenant, piece), the oldest forgotten first."""

    __slots__ = ("_chars", "_counts", "_lock", "_max_chars")

    def __init__(self, max_chars: int = MAX_CHARS) -> None:
        self._counts: dict[tuple[str, str], int] = {}
        self._chars = 0
        self._max_chars = max_chars
        self._lock = threading.Lock()  # counts also run on worker threads (long prompts)

    def __len__(self) -> int:
        return len(self._counts)

    @property
    def chars(self) -> int:
        """What the remembered pieces are charged against `max_chars`."""
        return self._chars

    def count(self, piece: str, encode: Callable[[str], int]) -> int:
        tenant = _tenant.get()
        if tenant is None or len(piece) > self._max_chars // 4:  # one piece never empties it
            return encode(piece)
        key = (tenant, piece)
        found = self._counts.get(key)
        if found is None:
            found = encode(piece)
            self._remember(key, found)
        return found

    def _remember(self, key: tuple[str, str], count: int) -> None:
        with self._lock:
            if key in self._counts:
                return
            self._counts[key] = count
            self._chars += len(key[1]) + ENTRY_CHARS
            while self._chars > self._max_chars:
                oldest = next(iter(self._counts))
                del self._counts[oldest]
                self._chars -= len(oldest[1]) + ENTRY_CHARS


def remembered(
    encode_ordinary: Callable[[str], int],
    specials: Iterable[str],
    memory: SegmentMemory,
    *,
    nfc: bool = False,
) -> Callable[[str], int]:
    """A count of texts with every special token in `specials` recognised (as tiktoken's
    `encode(text, allowed_special="all")` counts them), the pieces between from `memory`."""
    names = sorted(specials, key=len, reverse=True)  # the longest first where one prefixes another

    def ordinary(text: str) -> int:
        return memory.count(text, encode_ordinary)

    def normalised(text: str) -> int:
        return memory.count(unicodedata.normalize("NFC", text), encode_ordinary)

    def piece_counter(text: str) -> Callable[[str], int]:
        # Normalised after the special tokens are found, each piece on its own, as Hugging Face
        # tokenizers do: the whole text's NFC took '<|im_end|>' + U+0338 as '<|im_end≯'. A text
        # in NFC as it is has every piece in NFC (a piece's own marks compose as they did in
        # the text), so only a text that is not pays for a piece's check.
        return normalised if nfc and not unicodedata.is_normalized("NFC", text) else ordinary

    if not names:
        return lambda text: piece_counter(text)(text) if text else 0
    special = re.compile("|".join(map(re.escape, names)))

    def count(text: str) -> int:
        piece = piece_counter(text)
        total = start = 0
        for found in special.finditer(text):
            if found.start() > start:
                total += piece(text[start : found.start()])
            total += 1
            start = found.end()
        if start < len(text):
            total += piece(text[start:])
        return total

    return count
