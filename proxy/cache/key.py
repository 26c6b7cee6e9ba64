"""What a request's cache identity is: its exact key, its semantic partition, and its question.

The tenant is a hard, length-prefixed part of every digest (and of every Redis key name), never a
similarity signal, so no two tenants can ever share an entry, whatever their names.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import orjson

from proxy.policy.model import CacheSpec
from proxy.upstream.exactints import as_written

__all__ = ["CacheKey", "cache_key"]

# Fields that change how the answer is delivered or attributed, never what it says.
_DELIVERY_ONLY = frozenset(
    {
        "stream",
        "stream_options",
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
    }
)
_QUESTION_SLOT = "\0tw-question\0"


@dataclass(slots=True)
class CacheKey:
    """`partition` and `question` are set only when the request may be answered semantically."""

    tenant: str
    exact: str
    partition: str | None = None
    question: str | None = None


# The Responses and Messages APIs bypass the cache: their answers are not stored yet.
_CACHED = frozenset({"chat", "text_completion"})


def cache_key(
    tenant: str, model: str, operation: str, body: dict[str, Any], spec: CacheSpec, raw: bytes = b""
) -> CacheKey | None:
    """The request's identity, or None when its answer must not come from (or go to) the cache.
    `raw` is the client's body, for the integers past 64 bits `body` holds as floats."""
    if operation not in _CACHED or spec.mode == "off" or not _single_plain_answer(body):
        return None
    deterministic = _temperature(body) == 0
    if not deterministic and body.get("seed") is None and spec.mode != "always":
        return None
    canonical = _canonical(body, raw)
    exact = _digest(tenant, model, operation, canonical)
    question = _question(body) if operation == "chat" else None
    if spec.mode != "semantic" or not deterministic or question is None:
        return CacheKey(tenant, exact)
    if len(question) > spec.max_entry_bytes or len(question.encode()) > spec.max_entry_bytes:
        # Its vector keeps the question (for the guards) beside the answer: a longer one would
        # store more than an entry may hold, and take the guards as long to compare.
        return CacheKey(tenant, exact)
    messages = list(body["messages"])
    messages[-1] = {**messages[-1], "content": _QUESTION_SLOT}
    partition = _digest(tenant, model, operation, _canonical({**body, "messages": messages}, raw))
    return CacheKey(tenant, exact, partition, question)


def _temperature(body: dict[str, Any]) -> float:
    """An omitted temperature means 1, as at OpenAI."""
    value = body.get("temperature")
    return float(value) if isinstance(value, int | float) else 1.0


def _single_plain_answer(body: dict[str, Any]) -> bool:
    """One choice, no log-probabilities: what a stored answer can faithfully reproduce.
    Completions' `logprobs: 0` asks for the sampled tokens' own (false as a number, not
    as a request)."""
    n, logprobs = body.get("n"), body.get("logprobs")
    no_logprobs = logprobs is None or logprobs is False
    return (
        (n is None or n == 1)
        and no_logprobs
        and not body.get("top_logprobs")
        and not _asks_for_more(body)
    )


def _asks_for_more(body: dict[str, Any]) -> bool:
    """vLLM's `prompt_logprobs`, or a `return_*` flag set (vLLM's, SGLang's and LMDeploy's ask
    for the token ids, hidden states or routed experts): fields beside the text, which a stored
    answer does not keep."""
    if body.get("prompt_logprobs") is not None:
        return True
    for name in body:  # a plain loop over the names: the values are looked at only for a flag
        if name.startswith("return_") and body[name]:
            return True
    return False


def _question(body: dict[str, Any]) -> str | None:
    """The last message's text, when it is the user's; None otherwise."""
    messages = body.get("messages") or []
    last = messages[-1] if messages else None
    if not isinstance(last, dict) or last.get("role") != "user":
        return None
    content = last.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict)]
        if parts and all(p.get("type") == "text" for p in content if isinstance(p, dict)):
            return "\n".join(p for p in parts if isinstance(p, str))
    return None


def _canonical(body: dict[str, Any], raw: bytes) -> bytes:
    """The body with delivery-only fields gone, keys sorted and 0.0 written as 0 (1e300 stays a
    float: JSON writes no integer that large), and each integer past 64 bits as `raw` has it
    (orjson read it as the nearest float: two seeds one float apart shared a key)."""
    kept = {
        name: (int(value) if isinstance(value, float) and _small_integer(value) else value)
        for name, value in body.items()
        if name not in _DELIVERY_ONLY and name != "model"
    }
    content = orjson.dumps(kept, option=orjson.OPT_SORT_KEYS)
    return as_written(content, kept, raw, orjson.OPT_SORT_KEYS)


def _small_integer(value: float) -> bool:
    return value.is_integer() and abs(value) < 2**63


def _digest(tenant: str, model: str, operation: str, canonical: bytes) -> str:
    hasher = _prefixed(tenant, model, operation).copy()
    hasher.update(canonical)
    return hasher.hexdigest()[:40]


@lru_cache(maxsize=1024)
def _prefixed(tenant: str, model: str, operation: str) -> hashlib._Hash:
    """The digest's state after its version and the length-prefixed tenant, model and operation,
    made once for each (copied, never updated, by `_digest`)."""
    hasher = hashlib.sha256(b"tw-cache-v1\0")
    for part in (tenant.encode(), model.encode(), operation.encode()):
        hasher.update(len(part).to_bytes(4, "big"))
        hasher.update(part)
    return hasher
