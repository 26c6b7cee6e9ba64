"""What one finished request contributes to the metrics, with every label bounded by the policy."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.context import RequestContext
from proxy.policy import Policy
from proxy.telemetry.semconv import status_class
from proxy.upstream.meter import GapHistogram

__all__ = [
    "CACHE_RESULTS",
    "Labels",
    "RequestSample",
    "model_label",
    "rejection_of",
    "sample_of",
]

CACHE_RESULTS = frozenset({"hit", "semantic-hit", "miss", "bypass"})
_REJECTIONS = {"rate_limit_exceeded": "rate_limit", "insufficient_quota": "budget"}

Labels = tuple[str, str, str, str, str]
"""(tenant, operation, model, backend, status class): the one label set of per-request series."""


@dataclass(slots=True)
class RequestSample:
    labels: Labels
    input_tokens: int | None
    output_tokens: int | None
    cost_nusd: int
    duration_s: float
    gateway_s: float
    upstream_s: float | None  # request sent (to the backend that answered) -> last byte read
    upstream_ttft_s: float | None  # streams only: request sent (to it) -> first byte back
    ttft_s: float | None  # streams only: request received -> first token written
    time_per_token_s: float | None  # after the first token
    gaps: GapHistogram | None  # streams only: every inter-token gap
    cache: str
    saved_tokens: tuple[int, int]  # a cache hit's input and output tokens the backend was spared
    saved_nusd: int
    rejected: str | None  # "rate_limit" | "budget" | None
    degraded: tuple[str, ...]
    error_type: str | None


def sample_of(
    ctx: RequestContext,
    policy: Policy,
    cost_nusd: int,
    duration_s: float,
    saved_cost_nusd: int = 0,
) -> RequestSample:
    """The request's figures; a model or rule name the policy does not know becomes `other`."""
    meter = ctx.meter
    labels = (
        ctx.tenant_name or "",
        ctx.operation,
        model_label(ctx, policy),
        ctx.backend.name if ctx.backend else "",
        status_class(ctx.status),
    )
    upstream_s = None
    if meter.attempt_sent_s is not None and meter.upstream_first_byte_s is not None:
        upstream_s = meter.last_read_s - meter.attempt_sent_s
    streamed = ctx.stream and ctx.status == 200
    tokens_per_s = meter.tokens_per_s(ctx.output_tokens or 0, ctx.choices)
    # Token usage is a backend call's: a cache hit or a refusal no backend heard used none
    # (its 0 tokens dragged the histogram's percentiles down with every refusal).
    called = meter.upstream_sent_s is not None
    return RequestSample(
        labels=labels,
        input_tokens=ctx.input_tokens if called else None,
        output_tokens=ctx.output_tokens if called else None,
        cost_nusd=cost_nusd,
        duration_s=duration_s,
        gateway_s=meter.gateway_s,
        upstream_s=upstream_s,
        upstream_ttft_s=meter.upstream_ttft_s if ctx.stream else None,
        ttft_s=meter.ttft_s if streamed else None,
        time_per_token_s=1.0 / tokens_per_s if tokens_per_s else None,
        gaps=meter.gaps if streamed and meter.gaps.count else None,
        cache=ctx.cache if ctx.cache in CACHE_RESULTS else "other",
        saved_tokens=(ctx.saved_input_tokens, ctx.saved_output_tokens),
        saved_nusd=saved_cost_nusd,
        rejected=rejection_of(ctx),
        degraded=_degraded(ctx),
        error_type=ctx.error_code if ctx.status != 200 or ctx.error_code else None,
    )


def rejection_of(ctx: RequestContext) -> str | None:
    """The gateway's own 429 (the tenant's rate limit or budget): refused before any backend was
    asked. A backend's 429 passed on with the same code (its own limit, its account's credit)
    is no refusal of the gateway's."""
    if ctx.status != 429 or ctx.meter.upstream_sent_s is not None:
        return None
    return _REJECTIONS.get(ctx.error_code or "")


def model_label(ctx: RequestContext, policy: Policy) -> str:
    """The model as a label: a name the policy does not know (a client's typo) is `other`."""
    return ctx.model if not ctx.model or ctx.model in policy.models else "other"


def _degraded(ctx: RequestContext) -> tuple[str, ...]:
    """The degradation rules that applied, a name the tenant's policy does not know `other`
    (nothing is made for the request that none applied to, nearly every one)."""
    if not ctx.degraded:
        return ()
    rules = frozenset(rule.name for rule in ctx.tenant.degrade) if ctx.tenant else frozenset()
    return tuple(rule if rule in rules else "other" for rule in ctx.degraded)
