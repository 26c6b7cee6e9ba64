"""Remembered token counts are exact (the same as tiktoken's count of the whole text, special
tokens recognised), kept apart by tenant, and bounded."""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Callable

import pytest
import tiktoken
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.tokens.segments import SegmentMemory, counting_for, done_counting, remembered
from proxy.tokens.tiktoken_counter import encoding_from_file
from tests.shared import tokenizer_file

# Pieces a rendered chat is made of, and the awkward ones: combining marks that compose with
# the character before them (also with a special token's closing '>': '>' + U+0338 is '≯').
_PIECES = st.sampled_from(
    ["Hello", " world", "\n\n", "  ", "système", "e\u0301", "\u0338", ">", "<|", "|>", "中文",
     "🙂", "\u1100\u1161", "1234567", "don't", " \t", "<", "im_start", "ÅÅ"]
)  # fmt: skip


@pytest.fixture(scope="module", params=["qwen2.5/qwen.tiktoken", "llama-3/tokenizer.model"])
def encoding(request: pytest.FixtureRequest) -> tuple[tiktoken.Encoding, bool]:
    found, family = encoding_from_file(tokenizer_file(request.param), None)
    return found, family.nfc


def _whole(encoding: tiktoken.Encoding, nfc: bool) -> Callable[[str], int]:
    """tiktoken's count of the whole text; with `nfc`, each piece between special tokens
    normalised first, as Hugging Face tokenizers do (test_nfc_is_of_the_pieces_...)."""
    names = sorted(encoding.special_tokens_set, key=len, reverse=True)
    special = re.compile("|".join(map(re.escape, names)))

    def count(text: str) -> int:
        if nfc:
            pieces = special.split(text)
            tokens = [*special.findall(text), ""]
            normal = (
                unicodedata.normalize("NFC", p) + t for p, t in zip(pieces, tokens, strict=True)
            )
            text = "".join(normal)
        return len(encoding.encode(text, allowed_special="all"))

    return count


def _ordinary(encoding: tiktoken.Encoding, calls: list[str]) -> Callable[[str], int]:
    def count(text: str) -> int:
        calls.append(text)
        return len(encoding.encode_ordinary(text))

    return count


_FIXTURE = [HealthCheck.function_scoped_fixture]  # the module's encoding, the same each time


@settings(
    max_examples=60, derandomize=True, database=None, deadline=None, suppress_health_check=_FIXTURE
)
@given(parts=st.lists(st.one_of(_PIECES, st.integers(0, 40)), max_size=40))
def test_a_remembered_count_is_tiktoken_s_count_of_the_whole_text(
    encoding: tuple[tiktoken.Encoding, bool], parts: list[str | int]
) -> None:
    found, nfc = encoding
    specials = sorted(found.special_tokens_set)
    text = "".join(specials[p * 7 % len(specials)] if isinstance(p, int) else p for p in parts)
    count = remembered(_ordinary(found, []), specials, SegmentMemory(), nfc=nfc)
    counting = counting_for("alpha")
    try:
        first, again = count(text), count(text)  # the second from memory
    finally:
        done_counting(counting)
    assert first == again == _whole(found, nfc)(text)


def test_what_one_tenant_counted_is_counted_again_for_another(
    encoding: tuple[tiktoken.Encoding, bool],
) -> None:
    found, nfc = encoding
    system = "You are a careful assistant. " * 40  # one piece between special tokens
    start, end = sorted(found.special_tokens_set)[:2]  # the encoding's own (Qwen's, Llama's)
    text = f"{start}system\n{system}{end}\n{start}user\nHi{end}\n"
    calls: list[str] = []
    memory = SegmentMemory()
    count = remembered(_ordinary(found, calls), found.special_tokens_set, memory, nfc=nfc)
    expected = _whole(found, nfc)(text)

    def encoded_for(tenant: str | None) -> list[str]:
        calls.clear()
        counting = counting_for(tenant)
        try:
            assert count(text) == expected
        finally:
            done_counting(counting)
        return list(calls)

    pieces = encoded_for("alpha")  # alpha's first: every piece is encoded
    assert any(len(piece) > 1000 for piece in pieces)  # the system prompt among them
    assert encoded_for("alpha") == []  # alpha's again: all from memory
    assert encoded_for("beta") == pieces  # beta's first: nothing from alpha's memory
    unremembered = encoded_for(None)  # outside a request: never remembered
    assert len(unremembered) > len(pieces)  # a piece met twice is encoded twice
    assert encoded_for(None) == unremembered
    assert len(memory) == 2 * len(set(pieces))  # alpha's and beta's


def test_the_memory_forgets_the_oldest_past_its_bound(
    encoding: tuple[tiktoken.Encoding, bool],
) -> None:
    found, nfc = encoding
    memory = SegmentMemory(max_chars=2_000)
    count = remembered(_ordinary(found, []), (), memory, nfc=nfc)
    counting = counting_for("alpha")
    try:
        for n in range(50):
            text = f"Request number {n}: " + "word " * 60
            assert count(text) == _whole(found, nfc)(text)
            assert memory.chars <= 2_000
    finally:
        done_counting(counting)
    assert 1 <= len(memory) <= 2_000 // (300 + 128)


def test_nfc_is_of_the_pieces_between_special_tokens_as_hugging_face_normalises() -> None:
    """Hugging Face finds a tokenizer's special tokens in the text as sent and normalises only
    the pieces between: NFC of the whole text took '<|eot_id|>' + U+0338 as '<|eot_id≯', 10
    tokens where the backend reads 5. (Llama 3's tokenizer.json given Qwen's NFC normaliser.)"""
    found, _ = encoding_from_file(tokenizer_file("llama-3/tokenizer.model"), None)
    spec = json.loads(tokenizer_file("llama-3/tokenizer.json").read_text())
    hf = tokenizers.Tokenizer.from_str(json.dumps({**spec, "normalizer": {"type": "NFC"}}))
    count = remembered(_ordinary(found, []), found.special_tokens_set, SegmentMemory(), nfc=True)
    for text in ("hi<|eot_id|>\u0338 there", "e\u0301<|eot_id|>e\u0301", "<|eot_id|>\u0338"):
        assert count(text) == len(hf.encode(text, add_special_tokens=False).ids), text
