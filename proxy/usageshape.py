"""The usage object each API writes, from its two counts: shared by the gateway (the usage it
shows where it billed its own counts) and the mock backend. Imports nothing of the gateway."""

from __future__ import annotations

from typing import Any

__all__ = ["responses_usage"]


def responses_usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    """The Responses API's `usage`, its cached and reasoning details 0 (not counted apart)."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }
