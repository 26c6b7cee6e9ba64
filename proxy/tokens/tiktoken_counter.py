"""tiktoken adapters: OpenAI encodings by name (found in tiktoken's cache, else downloaded),
and tiktoken-format ranks files: OpenAI's, Qwen's qwen.tiktoken, Llama 3's tokenizer.model.
"""

from __future__ import annotations

import base64
import binascii
import re
from itertools import pairwise
from pathlib import Path
from typing import Any

import tiktoken
import tiktoken_ext.openai_public  # type: ignore[import-untyped]

from proxy.tokens.base import CountText, TokenCounter, TokenizerError
from proxy.tokens.builtin_templates import builtin_template
from proxy.tokens.chat import TemplatedCounter
from proxy.tokens.families import Family, family_for
from proxy.tokens.openai_chat import GPT4_RULE, GPT4O_RULE, OpenAIChatRule, RuleCounter
from proxy.tokens.segments import SegmentMemory, remembered

__all__ = ["encoding_from_file", "load_encoding", "load_file", "read_ranks"]


def _openai(name: str, encoding: tiktoken.Encoding, encoding_name: str) -> TokenCounter:
    """OpenAI's chat rule; special-token text counts as plain text, as OpenAI treats content."""
    rule: OpenAIChatRule = GPT4O_RULE if encoding_name.startswith("o200k") else GPT4_RULE
    count = remembered(_ordinary(encoding), (), SegmentMemory())
    return RuleCounter(name, count, rule)


# tiktoken's regex engine panics (a bare 500) on a run of about a million whitespace characters
# other than newlines, so a text longer than this is cut inside each longer run, every RUN_CUT
# characters from its start. A run of one character (spaces, tabs) counts exactly as it would
# whole (checked on cl100k, o200k, Qwen and Llama 3); a mixed run may count a token less a cut.
RUN_CUT = 65_536
_WHITESPACE = re.compile(r"\s+")


def _ordinary(encoding: tiktoken.Encoding) -> CountText:
    encode = encoding.encode_ordinary

    def count(text: str) -> int:
        if len(text) <= RUN_CUT:
            return len(encode(text))
        return sum(len(encode(part)) for part in _cut_long_runs(text))

    return count


def _cut_long_runs(text: str) -> list[str]:
    """`text` in parts, cut inside each whitespace run longer than RUN_CUT. Such a run covers two
    neighbouring characters of every (RUN_CUT // 2)th, so a text without two of those both
    whitespace is not scanned."""
    samples = text[:: RUN_CUT // 2]
    if not any(a.isspace() and b.isspace() for a, b in pairwise(samples)):
        return [text]
    cuts = [
        cut
        for run in _WHITESPACE.finditer(text)  # linear: each run is matched once
        if run.end() - run.start() > RUN_CUT
        for cut in range(run.start() + RUN_CUT, run.end(), RUN_CUT)
    ]
    bounds = [0, *cuts, len(text)]
    return [text[start:end] for start, end in pairwise(bounds)]


def load_encoding(name: str) -> TokenCounter:
    """`tiktoken:NAME`: tiktoken reads `$TIKTOKEN_CACHE_DIR/<sha1 of its URL>` or downloads."""
    if name not in tiktoken.list_encoding_names():
        known = ", ".join(sorted(tiktoken.list_encoding_names()))
        raise TokenizerError(f"unknown tiktoken encoding {name!r}; known: {known}")
    constructor = tiktoken_ext.openai_public.ENCODING_CONSTRUCTORS.get(name)
    try:
        encoding = _lean(constructor()) if constructor else tiktoken.get_encoding(name)
    except (OSError, ValueError) as exc:
        raise TokenizerError(
            f"cannot load tiktoken encoding {name!r} ({exc.__class__.__name__}: {exc}); tiktoken"
            " downloads it on first use: offline, put the file in TIKTOKEN_CACHE_DIR under its"
            " cache name, or give the .tiktoken file's path instead"
        ) from exc
    return _openai(f"tiktoken:{name}", encoding, name)


def read_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken ranks file: one `base64(token) rank` per line.

    Read here rather than with tiktoken.load, which would also copy the file into its cache.
    """
    try:
        lines = path.read_bytes().splitlines()
        return {
            base64.b64decode(token): int(rank)
            for token, rank in map(bytes.split, filter(None, lines))
        }
    except OSError as exc:
        raise TokenizerError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except (ValueError, binascii.Error):
        raise TokenizerError(
            f"{path} is not a tiktoken ranks file (lines of 'base64 rank'); a SentencePiece"
            " .model file (Llama 2, Mistral) needs its tokenizer.json instead"
        ) from None


def encoding_from_file(path: Path, family_name: str | None) -> tuple[tiktoken.Encoding, Family]:
    """A tiktoken-format file of a built-in family (recognised by its size, or named)."""
    ranks = read_ranks(path)
    family = family_for(len(ranks), family_name)
    encoding = _lean(
        {
            "name": family.name,
            "pat_str": family.pattern,
            "mergeable_ranks": ranks,
            "special_tokens": dict(family.special_tokens),
        }
    )
    return encoding, family


def _lean(spec: dict[str, Any]) -> tiktoken.Encoding:
    """The encoding `spec` describes (tiktoken.Encoding's arguments), its ranks held by
    tiktoken's Rust core only: the Python dict it is built from (20-30 MB for a vocabulary of
    150-200k tokens) is emptied once the core has copied it. tiktoken keeps that dict only to
    pickle an encoding, which the gateway never does."""
    ranks: dict[bytes, int] = spec["mergeable_ranks"]
    encoding = tiktoken.Encoding(**spec)
    ranks.clear()
    return encoding


def load_file(path: Path, family_name: str | None) -> TokenCounter:
    encoding, family = encoding_from_file(path, family_name)
    name = f"tiktoken:{path}#{family.name}"
    if family.chat_format == "openai":
        return _openai(name, encoding, family.name)
    return TemplatedCounter(
        name,
        _special_encoder(encoding, family),
        builtin_template(family.chat_format),
        chat_format=f"builtin:{family.chat_format}",
        added_per_text=family.added_per_text,
    )


def _special_encoder(encoding: tiktoken.Encoding, family: Family) -> CountText:
    """Counts with every special token recognised, as Hugging Face tokenizers do (Qwen's
    normalising to NFC each piece between special tokens); those pieces remembered."""
    specials = encoding.special_tokens_set
    return remembered(_ordinary(encoding), specials, SegmentMemory(), nfc=family.nfc)
