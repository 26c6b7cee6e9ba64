"""Tokenizer families a bare tiktoken-format ranks file can belong to: the published split
regex, special tokens and chat format of each. A file is recognised by its number of ranks,
or its family is named after '#' in the spec (`/models/qwen.tiktoken#qwen2`).
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.tokens.base import TokenizerError

__all__ = ["FAMILIES", "Family", "family_for"]

_CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
_O200K_PATTERN = "|".join(
    (
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    )
)
# Qwen splits digits one by one; Llama 3 groups up to three (like cl100k, without possessives).
_QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Added tokens of Qwen2.5 from id 151643 on; Qwen2 has only the first three. `<tool_call>`
# is not "special" to Hugging Face, but as an added token it is still one token in any text.
_QWEN25_SPECIAL = (
    *("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>"),
    *("<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>"),
    *("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"),
    *("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"),
    *("<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"),
)
# Llama 3's 256 special tokens from id 128000, named as in the Llama 3.2 release.
_LLAMA3_SPECIAL = (
    *("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>"),
    *("<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>"),
    *("<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"),
    *(f"<|reserved_special_token_{n}|>" for n in range(2, 247)),
)


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    ranks: int  # the number of BPE ranks in the family's file
    pattern: str
    special_tokens: tuple[tuple[str, int], ...]
    chat_format: str  # "openai", or the name of a built-in template
    added_per_text: int = 0  # tokens a backend adds to each completions prompt (Llama's BOS)
    nfc: bool = False  # Qwen's Hugging Face tokenizer NFC-normalises text first


def _numbered(names: tuple[str, ...], first: int) -> tuple[tuple[str, int], ...]:
    return tuple((name, first + offset) for offset, name in enumerate(names))


_CL100K_SPECIAL = (
    *(("<|endoftext|>", 100257), ("<|fim_prefix|>", 100258), ("<|fim_middle|>", 100259)),
    *(("<|fim_suffix|>", 100260), ("<|endofprompt|>", 100276)),
)
_O200K_SPECIAL = (("<|endoftext|>", 199999), ("<|endofprompt|>", 200018))

FAMILIES: tuple[Family, ...] = (
    Family("cl100k_base", 100256, _CL100K_PATTERN, _CL100K_SPECIAL, "openai"),
    Family("o200k_base", 199998, _O200K_PATTERN, _O200K_SPECIAL, "openai"),
    Family(
        "qwen2.5", 151643, _QWEN_PATTERN, _numbered(_QWEN25_SPECIAL, 151643), "qwen2.5", 0, True
    ),
    Family(
        "qwen2", 151643, _QWEN_PATTERN, _numbered(_QWEN25_SPECIAL[:3], 151643), "qwen2", 0, True
    ),
    Family("llama3.1", 128000, _LLAMA3_PATTERN, _numbered(_LLAMA3_SPECIAL, 128000), "llama3.1", 1),
    Family("llama3", 128000, _LLAMA3_PATTERN, _numbered(_LLAMA3_SPECIAL, 128000), "llama3", 1),
)


def family_for(ranks: int, name: str | None) -> Family:
    """The family named `name`, else the first (default) family with `ranks` ranks."""
    for family in FAMILIES:
        if family.name == name and family.ranks != ranks:
            raise TokenizerError(f"#{name} has {family.ranks} ranks, this file has {ranks}")
        if family.name == name or (name is None and family.ranks == ranks):
            return family
    names = ", ".join(f"#{family.name}" for family in FAMILIES)
    if name is not None:
        raise TokenizerError(f"unknown tokenizer family #{name}; built in: {names}")
    raise TokenizerError(
        f"a tiktoken file of {ranks} ranks matches no built-in family; name one: {names}"
    )
