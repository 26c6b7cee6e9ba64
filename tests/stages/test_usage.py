"""Which backend usage numbers the gateway believes (the rest is in tests/web/test_billing.py)."""

from __future__ import annotations

import pytest

from proxy.stages.usage import MAX_USAGE_TOKENS, checked_usage


@pytest.mark.parametrize(
    ("usage", "believed"),
    [
        ({"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21}, (9, 12)),
        ({"prompt_tokens": 9}, (9, 0)),  # embeddings report no completion
        ({"prompt_tokens": 9, "completion_tokens": None}, (9, 0)),
        ({"prompt_tokens": MAX_USAGE_TOKENS, "completion_tokens": 0}, (MAX_USAGE_TOKENS, 0)),
        ({"prompt_tokens": MAX_USAGE_TOKENS + 1, "completion_tokens": 0}, None),
        ({"prompt_tokens": 9, "completion_tokens": 2**64 - 1}, None),
        ({"prompt_tokens": -1, "completion_tokens": 12}, None),
        ({"prompt_tokens": True, "completion_tokens": 12}, None),
        ({"prompt_tokens": 9, "completion_tokens": False}, None),
        ({"prompt_tokens": 9.0, "completion_tokens": 12}, None),
        ({"prompt_tokens": "9", "completion_tokens": 12}, None),
        ({"completion_tokens": 12}, None),
        ({"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": -21}, None),
        ({"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 1e30}, None),
    ],
)
def test_only_non_negative_ints_in_range_are_believed(
    usage: dict[str, object], believed: tuple[int, int] | None
) -> None:
    assert checked_usage(usage) == believed
