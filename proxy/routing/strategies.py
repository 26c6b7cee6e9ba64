"""Balancing strategies: each puts a model's available backends in order of preference.

The route stage sends the request to the first and fails over down the rest of the list.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from collections.abc import Sequence
from typing import Any, Protocol

import orjson

from proxy.context import Admitted
from proxy.policy.model import Backend, Routing
from proxy.routing.health import BackendHealth

__all__ = [
    "MIN_AFFINITY_BOUND",
    "LeastInflight",
    "PrefixAffinity",
    "Strategy",
    "Weighted",
    "prefix_key",
    "strategy_for",
]

_VIRTUAL_NODES = 160  # ring points per unit of weight: keys spread within a few % of even
_PREFIX_CHARS = 2048  # of a completion prompt or an embedding input, for its prefix key
# A replica with fewer requests than this in flight is never too busy for its prefixes: at low
# load a bound relative to the mean (1 request each) would scatter prefixes for no gain.
MIN_AFFINITY_BOUND = 4


class Strategy(Protocol):
    def order(self, candidates: Sequence[BackendHealth], ctx: Admitted) -> list[BackendHealth]:
        """`candidates` (available, in policy order), best first."""


class LeastInflight:
    """Fewest requests in flight per unit of weight; ties take turns."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def order(self, candidates: Sequence[BackendHealth], ctx: Admitted) -> list[BackendHealth]:
        n = len(candidates)
        turn = next(self._turn)
        ranked = sorted(
            range(n),
            key=lambda i: (candidates[i].inflight / candidates[i].backend.weight, (i - turn) % n),
        )
        return [candidates[i] for i in ranked]


class Weighted:
    """Smooth weighted round robin (nginx's): turns in proportion to `weight`, interleaved."""

    def __init__(self) -> None:
        self._current: dict[str, int] = {}

    def order(self, candidates: Sequence[BackendHealth], ctx: Admitted) -> list[BackendHealth]:
        current = self._current
        total = 0
        for health in candidates:
            weight = health.backend.weight
            current[health.name] = current.get(health.name, 0) + weight
            total += weight
        ranked = sorted(candidates, key=lambda h: -current[h.name])
        current[ranked[0].name] -= total
        return ranked


class PrefixAffinity:
    """Consistent hashing on the prompt prefix, with bounded load (Mirrokni et al., 2018).

    Each backend owns points on a hash ring (in proportion to its weight); a request goes to
    the first backend clockwise from its prefix's hash that has fewer than `load_factor` times
    the mean in-flight load (or fewer than MIN_AFFINITY_BOUND), so a hot prefix spills to its
    next replica instead of queueing.
    """

    def __init__(self, backends: Sequence[Backend], load_factor: float) -> None:
        self._load_factor = load_factor
        points = [
            (_hash64(f"{b.name}#{i}".encode()), b.name)
            for b in backends
            for i in range(_VIRTUAL_NODES * b.weight)
        ]
        points.sort()
        self._hashes = [h for h, _ in points]
        self._owners = [name for _, name in points]

    def order(self, candidates: Sequence[BackendHealth], ctx: Admitted) -> list[BackendHealth]:
        by_name = {h.name: h for h in candidates}
        walk: list[BackendHealth] = []
        start = bisect.bisect(self._hashes, _hash64(prefix_key(ctx)))
        size = len(self._owners)
        for step in range(size):
            health = by_name.pop(self._owners[(start + step) % size], None)
            if health is not None:
                walk.append(health)
                if not by_name:
                    break
        walk += by_name.values()  # backends the ring does not know (none, unless misbuilt)
        load = sum(h.inflight for h in candidates) + 1
        bound = max(MIN_AFFINITY_BOUND, math.ceil(self._load_factor * load / len(candidates)))
        return [h for h in walk if h.inflight < bound] + [h for h in walk if h.inflight >= bound]


def strategy_for(routing: Routing, backends: Sequence[Backend], load_factor: float) -> Strategy:
    if routing == "weighted":
        return Weighted()
    if routing == "prefix_affinity":
        return PrefixAffinity(backends, load_factor)
    return LeastInflight()


def prefix_key(ctx: Admitted) -> bytes:
    """What requests sharing a KV-cacheable prefix have in common: for chat, the leading system
    (or developer) messages, else the first message; else the prompt's first characters."""
    body = ctx.body
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        leading: list[Any] = []
        for message in messages:
            if not isinstance(message, dict) or message.get("role") not in ("system", "developer"):
                break
            leading.append(message.get("content"))
        if not leading:
            first = messages[0]
            leading.append(first.get("content") if isinstance(first, dict) else first)
        return orjson.dumps(leading)
    text = body.get("prompt", body.get("input"))
    if isinstance(text, list) and text:
        text = text[0]
    return orjson.dumps(text)[:_PREFIX_CHARS] if text is not None else b""


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")
