"""Exact prompt-token counts per model, chosen by the policy's `tokenizer` spec.

Adapters (tiktoken, Hugging Face) import their packages only when a spec needs them.
"""

from proxy.tokens.base import (
    MEDIA_TOKENS,
    MEDIA_TOKENS_LOW,
    ChatTemplateError,
    Messages,
    Prompt,
    TokenCounter,
    TokenizerError,
    Tools,
)
from proxy.tokens.counters import INLINE_MAX_CHARS, TokenCounters, load_counter, load_tokenizers
from proxy.tokens.estimate import EstimateCounter, estimate_tokens

__all__ = [
    "INLINE_MAX_CHARS",
    "MEDIA_TOKENS",
    "MEDIA_TOKENS_LOW",
    "ChatTemplateError",
    "EstimateCounter",
    "Messages",
    "Prompt",
    "TokenCounter",
    "TokenCounters",
    "TokenizerError",
    "Tools",
    "estimate_tokens",
    "load_counter",
    "load_tokenizers",
]
