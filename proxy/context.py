"""The one object a request carries through every stage: who, what, how it went, and its timings.

It comes in two phases. A `RequestContext` is what the route makes of an arrival; auth turns it
into an `Admitted` one, whose tenant is known, and every stage after auth takes that type, so a
stage that needs the tenant cannot be run before auth. What the gateway sends upstream is
`ctx.outgoing` (proxy/outgoing.py, changed only through its methods); what came of the request
is `ctx.outcome`, written by forward and the cache's replay, and by the pipeline when it refuses
or loses the request."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from proxy.asgi.cancel import RequestScope
from proxy.outgoing import OutgoingRequest
from proxy.policy.model import Backend, DegradeRule, Tenant
from proxy.upstream.meter import StreamMeter

if TYPE_CHECKING:
    from proxy.asgi.direct import LentCycle
    from proxy.cache.answer import Answer
    from proxy.cache.plan import CachePlan
    from proxy.holds import Planned, RateLimitHold, Reservation, Routed
    from proxy.ledger.base import UsageRecord
    from proxy.telemetry.spanattrs import SpanAttributes
    from proxy.upstream.capture import Capture

__all__ = [
    "Admitted", "Chosen", "Operation", "Outcome", "RequestContext", "TraceHooks", "UsageSource",
]  # fmt: skip

Operation = Literal["chat", "text_completion", "embeddings", "responses", "messages"]
UsageSource = Literal["backend", "counted", "estimated", "counted_output", "cache"]
Chosen = tuple[DegradeRule | None, DegradeRule | None]
"""A request's degradation rules: the first matching enforced one, the first shadow one."""
"""Where a record's billed tokens come from (None: nothing billed, no backend answered):
the backend's usage; the gateway's count (exact tokenizer) or estimate (no tokenizer) when the
backend sent none it could believe; the backend's input with the gateway's larger output count;
a cache hit's stored usage."""


class TraceHooks(Protocol):
    """One request's spans, as the recorder drives them (monotonic times, seconds)."""

    @property
    def recording(self) -> bool:
        """False when the sampler left this request out (its spans record nothing)."""

    def stage_ran(self, name: str, started_s: float, ended_s: float) -> None: ...

    def upstream_started(self, ctx: RequestContext, now_s: float) -> dict[str, str]:
        """Open the backend call's span; returns the headers that carry it to the backend."""

    def upstream_ended(self, now_s: float, status: int | None, error: str | None) -> None: ...

    def finish(self, ctx: RequestContext, now_s: float, attributes: SpanAttributes | None) -> None:
        """End the request span with its GenAI attributes (None when it is not recording);
        draw the storage stages' spans."""


@dataclass(slots=True, eq=False)
class Outcome:
    """What came of the request: written by forward and the cache's replay as the answer goes
    out, and by the pipeline when it refuses the request or the client leaves."""

    status: int = 0
    error_code: str | None = None
    answered: bool = False  # the answer's end was sent (or an error in its place)
    completed: bool = False  # the backend's answer came whole
    client_disconnected: bool = False
    usage: dict[str, Any] | None = None  # the backend's usage as sent, kept with a cached answer
    backend_usage: tuple[int, int] | None = None  # (prompt, completion), checked
    usage_rejected: bool = False  # the backend sent usage with numbers not believed
    tail: bytes = b""  # the answer's last bytes: response model, finish reasons
    parsed: dict[str, Any] | None = None  # a whole answer's JSON, parsed once for every reader
    # The answer's last bytes as the client is to see them once the request is billed (the
    # usage billed in place of a backend's not believed); None, as nearly always, to send them
    # as they are (proxy/stages/shown.py).
    reshow: Callable[[RequestContext, bytes], bytes] | None = None
    as_sent: bool = True  # `parsed` is what the backend sent (not read leniently, changed)
    stored_id: str | None = None  # what the backend keeps of the answer: its id, its container

    def refused(self, status: int, code: str) -> None:
        """The gateway answered with an error of its own."""
        self.status, self.error_code, self.answered = status, code, True


@dataclass(slots=True, eq=False)
class RequestContext:
    request_id: str
    operation: Operation
    received_s: float
    received_wall: float
    meter: StreamMeter
    headers: Mapping[str, str] = field(default_factory=dict)
    raw_body: bytes = b""
    tenant_name: str | None = None
    tenant: Tenant | None = None
    key_id: str | None = None  # the key's non-secret id (proxy.keys.record.key_id_of)
    end_user: str | None = None  # the body's `user` and the tags, as stages/attribute.py checked
    tags: tuple[str, ...] = ()
    outgoing: OutgoingRequest = field(default_factory=lambda: OutgoingRequest({}))
    stream: bool = False
    client_wants_usage: bool = False
    backend: Backend | None = None
    outcome: Outcome = field(default_factory=Outcome)
    cache: str = "bypass"
    cache_plan: CachePlan | None = None
    cached: Answer | None = None
    cache_similarity: float | None = None
    # Set by a degradation rule for the cache's second lookup: a looser bar, or stale answers.
    cache_min_similarity: float | None = None
    cache_serve_stale: bool = False
    saved_input_tokens: int = 0
    saved_output_tokens: int = 0
    degrade_choice: Chosen | None = None  # chosen before admission, applied after the cache
    degraded: list[str] = field(default_factory=list)
    degraded_shadow: list[str] = field(default_factory=list)  # rules that would have fired
    route: Routed | None = None
    planned: Planned | None = None  # the admission stages' storage steps, taken together
    counted_input_tokens: int | None = None
    reservation: Reservation | None = None
    rate_limits: list[RateLimitHold] = field(default_factory=list)
    # The model the rate-limit stage admitted the request on: another one that serves it (a
    # degradation rule's, a fallback) is admitted on its own `per_model` limits when routed.
    limited_model: str | None = None
    rate_limit_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    input_tokens: int | None = None
    output_tokens: int | None = None
    usage_source: UsageSource | None = None
    released: bool = False
    trace: TraceHooks | None = None  # None unless tracing is configured
    capture: Capture | None = None  # the answer as relayed, for the cache and `log_content`
    checkpointed: UsageRecord | None = None  # the last checkpoint; the final record supersedes it
    server_cycle: LentCycle | None = None  # lent by the server for a stream's direct writes
    # The (tenant, model) labels a stream's in-flight gauge went up under: a fallback model
    # may serve it, and the gauge must come down where it went up.
    inflight_labels: tuple[str, str] | None = None

    @property
    def model(self) -> str:
        """The model the request goes to (the client's until a stage changes it)."""
        return self.outgoing.model

    @property
    def body(self) -> dict[str, Any]:
        """The body sent upstream (the client's, as the stages changed it)."""
        return self.outgoing.body

    @property
    def choices(self) -> int:
        """How many answers the client gets: its `n` (1 if it sets none), for each prompt of a
        completions batch (as parse read them)."""
        return self.outgoing.choices

    @property
    def status(self) -> int:
        return self.outcome.status

    @property
    def error_code(self) -> str | None:
        return self.outcome.error_code

    def admit(self, tenant_name: str, tenant: Tenant, key_id: str | None) -> Admitted:
        """The request, its caller known: what the route and telemetry set on arrival, carried
        over (auth is the first stage; nothing else is set before it)."""
        return Admitted(
            self.request_id, self.operation, self.received_s, self.received_wall, self.meter,
            self.headers, outgoing=self.outgoing, outcome=self.outcome, trace=self.trace,
            capture=self.capture, server_cycle=self.server_cycle,
            tenant_name=tenant_name, tenant=tenant, key_id=key_id,
        )  # fmt: skip

    @property
    def upstream_path(self) -> str:
        return _UPSTREAM_PATHS[self.operation]

    def gateway_headers(self) -> list[tuple[bytes, bytes]]:
        """The headers the gateway adds to every answer for this request."""
        headers = [(b"x-tokenweir-cache", self.cache.encode()), *self.rate_limit_headers]
        if self.cache_similarity is not None:
            similarity = f"{self.cache_similarity:.4f}".encode()
            headers.append((b"x-tokenweir-cache-similarity", similarity))
        if self.outgoing.shaped:
            headers.append((b"x-tokenweir-shaped", ",".join(self.outgoing.shaped).encode()))
        if self.degraded:
            headers.append((b"x-tokenweir-degraded", ",".join(self.degraded).encode()))
        if self.degraded_shadow:
            shadow = ",".join(self.degraded_shadow).encode()
            headers.append((b"x-tokenweir-degraded-shadow", shadow))
        return headers


@dataclass(slots=True, eq=False, kw_only=True)
class Admitted(RequestContext):
    """A request after auth: its tenant is known. Every stage after auth takes this type."""

    tenant_name: str
    tenant: Tenant
    scope: RequestScope = field(default_factory=RequestScope)  # the client leaving cancels it
    # A runtime key with a token allowance of its own: its input is counted, as a quota's is.
    key_counts_tokens: bool = False


_UPSTREAM_PATHS: dict[str, str] = {
    "chat": "/chat/completions",
    "text_completion": "/completions",
    "embeddings": "/embeddings",
    "responses": "/responses",  # OpenAI's Responses API, served as is (vLLM, SGLang)
    "messages": "/messages",  # Anthropic's Messages API, served as is (vLLM, SGLang)
}
