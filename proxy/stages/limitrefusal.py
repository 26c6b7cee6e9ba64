"""The 429 a rate limit answers: which limit refused, its value, and when to retry (or that the
request can never fit it)."""

from __future__ import annotations

from proxy.context import Admitted
from proxy.errors import MINUTE_S, RateLimited
from proxy.stages.limitheaders import format_reset
from proxy.stages.limitshape import LimitShape, limit_key
from proxy.storage.limits import Admission, LimitKey

__all__ = ["limit_refusal", "refused_unsent"]


def limit_refusal(
    shape: LimitShape, costs: list[int], admission: Admission, *, holder: str = "this key"
) -> RateLimited:
    """The refusal of the limit `admission` names; `holder` is whose limits they are."""
    buckets, slots = shape.buckets, shape.slots
    index = admission.refused if admission.refused is not None else 0
    retry_s = admission.retry_after_s
    if index >= len(buckets):
        pool = slots[index - len(buckets)]
        what = f"max_concurrent{_on_model(limit_key(pool))}: {pool.size} requests in flight"
    else:
        bucket = buckets[index]
        name = limit_key(bucket)
        what = (
            f"{name.kind}_per_minute{_on_model(name)}: limit {bucket.capacity}, "
            f"this request needs {costs[index]}"
        )
        if costs[index] > bucket.capacity:
            return RateLimited(
                f"Rate limit exceeded: {what}; it is larger than the per-minute limit and can "
                "never be admitted. Lower max_tokens or n, send fewer prompts, or shorten the "
                "input.",
                retry_after_s=MINUTE_S,
                should_retry=False,
            )
    wait = format_reset(retry_s)
    refusal = RateLimited(
        f"Rate limit reached for {holder} ({what}). Please try again in {wait}.",
        retry_after_s=retry_s,
    )
    refusal.on_tokens = index < len(buckets) and limit_key(buckets[index]).kind == "tokens"
    return refusal


def _on_model(name: LimitKey) -> str:
    """` on model NAME` for a per-model limit, else nothing."""
    return f" on model {name.model}" if name.model is not None else ""


def refused_unsent(ctx: Admitted) -> bool:
    """Refused after the limits admitted it, before any backend was asked (a degradation rule's
    rejection, a shed request, a later limit, every backend full) and not answered from the
    cache: a refused request takes nothing, so the per-minute requests it took are given back."""
    unsent = ctx.meter.upstream_sent_s is None and ctx.cached is None
    return unsent and ctx.outcome.error_code is not None
