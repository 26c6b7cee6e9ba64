"""The OpenTelemetry GenAI semantic-convention names and bucket boundaries tokenweir speaks.

One place for the vocabulary, so spans, Prometheus and OTLP metrics cannot drift apart.
"""

from __future__ import annotations

__all__ = [
    "CHUNK_S",
    "DURATION_S",
    "MAX_TEXT_CHARS",
    "OVERHEAD_S",
    "PROVIDER",
    "SERVER_TTFT_S",
    "TOKENS",
    "clipped",
    "status_class",
]

MAX_TEXT_CHARS = 64
"""The most of a client's or backend's string (an unknown model, an error code) any record keeps."""


def clipped(text: str | None) -> str | None:
    """`text`, cut to MAX_TEXT_CHARS with a marker (an ellipsis) when longer."""
    if text is None or len(text) <= MAX_TEXT_CHARS:
        return text
    return text[: MAX_TEXT_CHARS - 1] + "\u2026"


# gen_ai.provider.name: every backend speaks OpenAI's API, whatever serves it (vLLM, SGLang, ...).
PROVIDER = "openai"

# The spec's ExplicitBucketBoundaries (semantic-conventions, docs/gen-ai/gen-ai-metrics.md).
TOKENS: tuple[float, ...] = (
    1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864,
)  # fmt: skip
DURATION_S: tuple[float, ...] = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
SERVER_TTFT_S: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
# The spec's time-per-chunk/token boundaries start at 10 ms, where a 750 tokens/s backend's
# 1.3 ms gaps would all share the first bucket; 1, 2.5 and 5 ms are added below them (a superset:
# every boundary of the spec is still there).
CHUNK_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005,
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
# Not in the spec: time spent in the gateway's own code, from 50 µs.
OVERHEAD_S: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
)  # fmt: skip

_STATUS_CLASSES = ("none", "1xx", "2xx", "3xx", "4xx", "5xx")


def status_class(status: int) -> str:
    """`2xx`, `4xx`, ...; `none` for a request that never got a status (client gone first)."""
    return _STATUS_CLASSES[status // 100] if 100 <= status < 600 else "none"
