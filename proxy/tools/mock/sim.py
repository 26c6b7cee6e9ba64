"""The mock backend's simulations: TTFT that grows with load and drops on prefix reuse, and
faults a whole backend shows (every answer failing, every stream dying)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import orjson

from proxy.tools.mock.request import Knobs
from proxy.tools.mock.text import count_words

__all__ = ["Faults", "LoadModel"]

_TOKENS_PER_MESSAGE = 4


@dataclass(frozen=True, slots=True)
class Faults:
    """Knobs applied to every request that does not set its own."""

    fail_status: int | None = None
    fail_after_tokens: int | None = None

    def apply(self, knobs: Knobs) -> Knobs:
        return replace(
            knobs,
            fail_status=knobs.fail_status if knobs.fail_status is not None else self.fail_status,
            fail_after_tokens=(
                knobs.fail_after_tokens
                if knobs.fail_after_tokens is not None
                else self.fail_after_tokens
            ),
        )


class LoadModel:
    """Extra TTFT, as a vLLM/SGLang replica would show it.

    `load_ttft_s` per other request in flight (batching slows prefill), and `prefill_s_per_token`
    for each prompt token whose KV is not cached. The cache is an LRU of `prefix_cache_size`
    prompt prefixes (the leading system messages); a request whose prefix is in it prefills
    only the rest of its prompt.
    """

    def __init__(
        self, *, load_ttft_s: float, prefill_s_per_token: float, prefix_cache_size: int
    ) -> None:
        self._load_ttft_s = load_ttft_s
        self._prefill_s_per_token = prefill_s_per_token
        self._size = prefix_cache_size
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self.prefix_hits = 0
        self.prefix_misses = 0

    def extra_ttft_s(self, body: dict[str, Any], prompt_tokens: int, others_inflight: int) -> float:
        extra_s = self._load_ttft_s * others_inflight
        if self._prefill_s_per_token <= 0:
            return extra_s
        cached = self._cached_tokens(body)
        return extra_s + self._prefill_s_per_token * max(0, prompt_tokens - cached)

    def _cached_tokens(self, body: dict[str, Any]) -> int:
        """Tokens of the request's prefix already cached (then touched), else 0 (then cached)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or self._size <= 0:
            return 0
        leading = []
        for message in messages:
            if not isinstance(message, dict) or message.get("role") not in ("system", "developer"):
                break
            leading.append(message.get("content"))
        if not leading:
            return 0
        key = orjson.dumps(leading)
        if key in self._seen:
            self._seen.move_to_end(key)
            self.prefix_hits += 1
            texts = (c if isinstance(c, str) else "" for c in leading)
            return sum(count_words(t) + _TOKENS_PER_MESSAGE for t in texts)
        self.prefix_misses += 1
        self._seen[key] = None
        if len(self._seen) > self._size:
            self._seen.popitem(last=False)
        return 0
