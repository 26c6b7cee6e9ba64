"""OpenAI's x-ratelimit-* headers from the buckets a request was admitted on: the tighter limit
of each kind (requests, tokens), resets written as OpenAI writes them."""

from __future__ import annotations

import math
from collections.abc import Sequence

from proxy.storage.limits import BucketState

__all__ = ["format_reset", "rate_limit_headers", "tighter"]

Headers = list[tuple[bytes, bytes]]

_HEADER_NAMES = {
    kind: (
        b"x-ratelimit-limit-" + kind,
        b"x-ratelimit-remaining-" + kind,
        b"x-ratelimit-reset-" + kind,
    )
    for kind in (b"requests", b"tokens")
}


def rate_limit_headers(counts_tokens: Sequence[bool], states: Sequence[BucketState]) -> Headers:
    """OpenAI's six headers from the buckets' states (`counts_tokens`: for each, tokens, else
    requests); with a per-model limit too, the tighter of each kind is shown."""
    tightest: dict[bytes, BucketState] = {}
    for counted, state in zip(counts_tokens, states):  # noqa: B905 (one per bucket)
        kind = b"tokens" if counted else b"requests"
        known = tightest.get(kind)
        if known is None or state.remaining < known.remaining:
            tightest[kind] = state
    headers: Headers = []
    for kind, state in tightest.items():
        limit, remaining, reset = _HEADER_NAMES[kind]
        headers += (
            (limit, b"%d" % state.limit),
            (remaining, b"%d" % state.remaining),
            (reset, format_reset(state.reset_s).encode()),
        )
    return headers


def tighter(shown: Headers, more: Headers) -> Headers:
    """The headers of two admissions as one: of each kind, the one with less remaining."""
    kinds: dict[bytes, Headers] = {}
    for headers in (shown, more):
        for kind, (_, remaining, _) in _HEADER_NAMES.items():
            triple = [(name, value) for name, value in headers if name.endswith(kind)]
            left = dict(triple).get(remaining)
            known = dict(kinds.get(kind, ())).get(remaining)
            if left is not None and (known is None or int(left) < int(known)):
                kinds[kind] = triple
    return [header for triple in kinds.values() for header in triple]


def format_reset(seconds: float) -> str:
    """A duration as OpenAI writes its reset headers: `20ms`, `1s`, `6m0s`, `1h2m3s`."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"
