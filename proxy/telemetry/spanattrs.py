"""The request span's attributes as both span paths take them: values in a fixed key order,
those that repeat from request to request apart from those that rarely do."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import chain
from typing import NamedTuple

__all__ = ["REPEATING_KEYS", "VARYING_KEYS", "SpanAttributes"]

# The request span's attribute keys: first those whose values repeat from request to request
# (the direct path encodes each combination of them once), then those that rarely repeat.
REPEATING_KEYS = (
    "gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.request.model",
    "gen_ai.response.model", "gen_ai.request.max_tokens", "gen_ai.request.stream",
    "gen_ai.response.finish_reasons", "server.address", "server.port",
    "http.response.status_code", "error.type", "tokenweir.tenant", "tokenweir.backend",
    "tokenweir.cache", "tokenweir.degraded", "tokenweir.shaped", "tokenweir.client_disconnected",
)  # fmt: skip
VARYING_KEYS = (
    "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens",
    "gen_ai.response.time_to_first_chunk", "tokenweir.request_id", "tokenweir.ttft_s",
    "tokenweir.upstream_ttft_s", "tokenweir.tokens_per_second", "tokenweir.gateway_s",
    "tokenweir.cost_usd",
)  # fmt: skip


class SpanAttributes(NamedTuple):
    """The request span's attributes, by REPEATING_KEYS and VARYING_KEYS; None is no value."""

    repeating: tuple[object, ...]
    varying: tuple[object, ...]

    def varying_items(self) -> Iterator[tuple[str, object]]:
        return zip(VARYING_KEYS, self.varying, strict=True)

    def items(self) -> Iterator[tuple[str, object]]:
        """Every (key, value), the None values too."""
        return chain(zip(REPEATING_KEYS, self.repeating, strict=True), self.varying_items())

    def as_dict(self) -> dict[str, object]:
        """The attributes that have a value."""
        return {key: value for key, value in self.items() if value is not None}
