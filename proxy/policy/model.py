"""The policy's typed shape: frozen pydantic models, unknown keys rejected, units resolved."""

from __future__ import annotations

from decimal import Decimal
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    model_validator,
)

from proxy.policy.numbers import NoBoolAsNumber
from proxy.policy.settings import (
    backend_key,
    client_key,
    has_control,
    setting,
)
from proxy.policy.units import parse_bytes, parse_duration_s, split_sqlite_url
from proxy.storage.redis.url import check_storage_url, is_redis_url

__all__ = [
    "Backend",
    "Budget",
    "CacheSpec",
    "CircuitSpec",
    "DegradeRule",
    "EmbedderSpec",
    "HnswSpec",
    "Limits",
    "ModelSpec",
    "Policy",
    "Price",
    "Routing",
    "ServerSpec",
    "Tenant",
    "UpstreamSpec",
    "VerifierSpec",
]

Seconds = Annotated[float, BeforeValidator(parse_duration_s)]
Bytes = Annotated[int, BeforeValidator(parse_bytes)]
ClientKey = Annotated[str, BeforeValidator(client_key)]
Ratio = Annotated[float, Field(ge=0.0, le=1.0)]
PositiveInt = Annotated[int, Field(gt=0)]
PositiveSeconds = Annotated[float, BeforeValidator(parse_duration_s), Field(gt=0.0)]


def _printable(name: str) -> str:
    if has_control(name):
        raise ValueError(
            "names may not hold a newline or another control character: they go into headers "
            "(x-tokenweir-degraded), log lines and metric labels"
        )
    return name


Name = Annotated[str, Field(min_length=1, max_length=200), AfterValidator(_printable)]


def _no_braces(name: str) -> str:
    if "{" in name or "}" in name:
        raise ValueError("names may not contain { or }: they become Redis hash tags (tw:{name})")
    return name


TagName = Annotated[Name, AfterValidator(_no_braces)]


def _ledger_url(url: str) -> str:
    if url.startswith("sqlite:///"):
        split_sqlite_url(url)
        return url
    if url == "redis":
        return url
    if is_redis_url(url):
        return check_storage_url(url)
    raise ValueError(
        "a ledger is sqlite:///relative.db, sqlite:////absolute.db, redis://host:port/db, "
        "or redis (the storage's Redis)"
    )


def _backend_url(url: str) -> str:
    """The URL without its trailing slash. Messages never repeat it: it may hold a secret."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(
            "a backend url starts with http:// or https://, e.g. http://127.0.0.1:8000/v1"
        )
    parts = urlsplit(url)
    if "@" in parts.netloc:  # never sent on requests, and the URL is a span attribute
        raise ValueError(
            "a backend url carries no user or password (user:password@): put the backend's "
            "key in its api_key (sent as Authorization: Bearer), e.g. api_key: ${BACKEND_KEY}"
        )
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise ValueError(
            "a backend url has no ?query or #fragment: the gateway adds the request's path "
            "(/chat/completions) after it; a key goes in the backend's api_key"
        )
    return url.rstrip("/")


class _Frozen(NoBoolAsNumber):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)


def _priced_in_pico(price: float) -> float:
    """A price of whole pico-USD a token (at most 6 decimals per million tokens): costs are
    counted in them, and a finer price would be rounded (a price per token typed here, to 0)."""
    exact = Decimal(repr(price))
    if exact.scaleb(6) % 1 == 0:
        return price
    raise ValueError(
        f"{exact:f} USD per million tokens is finer than costs are counted (0.000001 USD per "
        f"million tokens, a pico-USD a token); if it is a price per token, per million tokens "
        f"it is {price * 1e6:.6g}"
    )


# The dearest price a policy may give, USD per million tokens: 8 times the dearest model on sale
# (o1-pro's output, $600). At it, a request of the most usage believed (10^8 input and 10^8
# output tokens) costs 10^15 nano-USD, the most a ledger record holds: a dearer price let a
# record be clipped below what its quota booked (at $1 a token, 3 million tokens booked
# $3,000,001 on the quota and $1,000,000 in the ledger).
MAX_PRICE_PER_1M = 5_000
PricePer1M = Annotated[float, Field(ge=0, le=MAX_PRICE_PER_1M), AfterValidator(_priced_in_pico)]


class Price(_Frozen):
    """USD per million tokens, for cost reports."""

    input_per_1m: PricePer1M = 0.0
    output_per_1m: PricePer1M = 0.0


Routing = Literal["least_inflight", "weighted", "prefix_affinity"]


class ModelSpec(_Frozen):
    tokenizer: str | None = None
    price: Price = Price()
    # How requests are spread over the model's backends; see README, "Routing and failover".
    routing: Routing = "least_inflight"
    # With prefix_affinity: a replica takes at most this factor times the mean in-flight load.
    affinity_load_factor: Annotated[float, Field(ge=1.0, le=10.0)] = 2.0
    # Backends tried for one request (the first included) when they fail before the first byte.
    max_attempts: Annotated[int, Field(ge=1, le=10)] = 3
    # Models to serve the request, in order, when none of this model's backends is available.
    fallback_models: tuple[Name, ...] = ()


class LimitSet(_Frozen):
    """Limits on one model for a tenant (on top of its own), or on a backend for everyone."""

    requests_per_minute: PositiveInt | None = None
    tokens_per_minute: PositiveInt | None = None
    max_concurrent: PositiveInt | None = None


class Backend(_Frozen):
    name: TagName
    url: Annotated[str, BeforeValidator(setting), AfterValidator(_backend_url)]
    # Resolved once: a key from the environment is used as it is, even with "${" in it.
    api_key: Annotated[SecretStr | None, BeforeValidator(backend_key)] = None
    models: tuple[Name, ...] = Field(min_length=1)
    weight: PositiveInt = 1
    limits: LimitSet = LimitSet()
    # Overrides upstream.first_byte_timeout for this backend (a slow-prefill server, say).
    first_byte_timeout: PositiveSeconds | None = None


class Budget(_Frozen):
    system_prompt: str | None = None
    max_input_tokens: PositiveInt | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    temperature_max: Annotated[float, Field(ge=0, le=2)] | None = None
    history_limit: Annotated[int, Field(ge=0)] | None = None
    on_input_overflow: Literal["trim", "reject"] = "trim"
    stop_stream_at_budget: bool = False
    # A cache hit is charged to the quotas as if the backend had answered (the ledger still
    # records it as a hit, with what it saved).
    charge_cache_hits: bool = False
    tokens_per_day: PositiveInt | None = None
    tokens_per_month: PositiveInt | None = None
    usd_per_day: Annotated[float, Field(gt=0)] | None = None
    usd_per_month: Annotated[float, Field(gt=0)] | None = None


class Limits(_Frozen):
    requests_per_minute: PositiveInt | None = None
    tokens_per_minute: PositiveInt | None = None
    max_concurrent: PositiveInt | None = None
    per_model: dict[Name, LimitSet] = Field(default_factory=dict)
    queue_timeout: Seconds | None = None
    on_storage_error: Literal["open", "closed"] = "open"
    # How long a dead replica's concurrency slots outlive it; renewed every third of it.
    lease_ttl: Annotated[float, BeforeValidator(parse_duration_s), Field(ge=1.0)] = 60.0


class HnswSpec(_Frozen):
    """The HNSW graph of Redis's vector search (FT.SEARCH or vector sets): more is better recall,
    slower adds and lookups."""

    m: Annotated[int, Field(ge=4, le=128)] = 16
    ef_construction: Annotated[int, Field(ge=8, le=4096)] = 200
    # Measured on the semcache dev pairs: see docs/benchmarks.md, "semantic cache engines".
    ef_runtime: Annotated[int, Field(ge=1, le=4096)] = 128


class VerifierSpec(_Frozen):
    """A cross-encoder (`POST {backend}/rerank`) confirms each candidate above `min_similarity`;
    a hit needs its relevance score at or above `threshold`; no answer within `timeout`: miss."""

    backend: Name
    model: Name
    threshold: Ratio = 0.5
    min_similarity: Ratio = 0.9
    timeout: PositiveSeconds = 1.0


class CacheSpec(_Frozen):
    mode: Literal["off", "exact", "semantic", "always"] = "off"
    similarity: Ratio = 0.96  # measured: see docs/benchmarks.md, "semantic cache precision"
    ttl: Seconds = 3600.0
    max_entry_bytes: Bytes = 256 * 1024
    # Least recently used entries beyond this many (per tenant) are evicted.
    max_entries: PositiveInt = 10_000
    # auto (and redis): RediSearch's FT.SEARCH where the server has it, else Redis 8's vector
    # sets, else the in-process mirror; redis-search / redis-vsets: that one engine (or the
    # mirror, with a warning); local: the mirror always.
    vector_search: Literal["auto", "redis", "redis-search", "redis-vsets", "local"] = "auto"
    hnsw: HnswSpec = HnswSpec()
    verifier: VerifierSpec | None = None


class EmbedderSpec(_Frozen):
    """Where the semantic cache's vectors come from: exactly one of `model` or `local`."""

    model: Name | None = None
    local: Literal["all-MiniLM-L6-v2"] | None = None
    timeout: PositiveSeconds = 2.0

    @model_validator(mode="after")
    def _exactly_one(self) -> EmbedderSpec:
        if (self.model is None) == (self.local is None):
            raise ValueError("set exactly one of embedder.model or embedder.local")
        return self


class DegradeWhen(_Frozen):
    inflight_ratio_above: Ratio | None = None
    queue_depth_above: Annotated[int, Field(ge=0)] | None = None
    backend_ttft_p95_above: Seconds | None = None
    backend_error_rate_above: Ratio | None = None
    budget_used_above: Ratio | None = None
    storage_unavailable: bool | None = None


class DegradeThen(_Frozen):
    max_output_tokens: PositiveInt | None = None
    model: Name | None = None
    cache: Literal["serve_stale"] | None = None
    similarity: Ratio | None = None
    reject: Literal[429, 503] | None = None
    retry_after: Seconds = 1.0  # with reject: the Retry-After the client is told
    priority: Literal["low", "normal", "high"] | None = None


class DegradeRule(_Frozen):
    name: Name
    when: DegradeWhen
    then: DegradeThen
    # Evaluate and record (x-tokenweir-degraded-shadow, the access log), change nothing.
    shadow: bool = False


class Tenant(_Frozen):
    api_keys: tuple[ClientKey, ...] = Field(min_length=1)
    models: tuple[Name, ...] = Field(min_length=1)
    budget: Budget = Budget()
    limits: Limits = Limits()
    cache: CacheSpec = CacheSpec()
    degrade: tuple[DegradeRule, ...] = ()
    priority: Literal["low", "normal", "high"] = "normal"
    # Every degrade rule and priority shedding of this tenant in shadow mode (see DegradeRule).
    shadow: bool = False


class ServerSpec(_Frozen):
    """How the gateway treats its own clients; the timeouts end slow or stalled clients."""

    max_body_bytes: Bytes = 4 * 1024 * 1024
    # The request line and headers must arrive within this (`tokenweir serve`); else 408, closed.
    header_timeout: PositiveSeconds = 10.0
    # The whole request body must arrive within this; else 408 `request_timeout`.
    body_timeout: PositiveSeconds = 60.0
    # An idle keep-alive connection is closed after this (`tokenweir serve`).
    keep_alive_timeout: PositiveSeconds = 5.0
    # On SIGTERM: requests in flight may finish within this; then they are ended with an error.
    drain_timeout: Annotated[float, BeforeValidator(parse_duration_s), Field(ge=0.0)] = 30.0


class CircuitSpec(_Frozen):
    """Passive health: `failures` in a row open a backend's circuit for `open_for`, doubled on
    each failed trial up to `max_open_for`; one successful trial closes it."""

    failures: PositiveInt = 3
    open_for: Annotated[float, BeforeValidator(parse_duration_s), Field(gt=0.0)] = 2.0
    max_open_for: Annotated[float, BeforeValidator(parse_duration_s), Field(gt=0.0)] = 60.0


class UpstreamSpec(_Frozen):
    """The shared connection pool to backends; `read_timeout` is the idle limit per chunk."""

    # Above 0: a timeout of 0 is not "none" but at once (every request a 504).
    connect_timeout: PositiveSeconds = 5.0
    read_timeout: PositiveSeconds = 300.0
    # The longest wait from sending a request to the first byte of the answer's body; unset,
    # read_timeout covers that wait too.
    first_byte_timeout: PositiveSeconds | None = None
    # The longest one backend call may take, from sending the request to the answer's end.
    total_timeout: PositiveSeconds = 600.0
    pool_timeout: Seconds = 5.0
    max_connections: PositiveInt = 2048
    # A whole (non-stream) answer longer than this is a 502; streams pass through unbuffered.
    max_response_bytes: Bytes = 32 * 1024 * 1024
    # The answer's status line and headers together (and, after them, the bytes between body
    # bytes: chunk framing, trailers), and how many headers (trailers included).
    max_header_bytes: Bytes = 64 * 1024
    max_headers: PositiveInt = 256
    # Active health checks: `GET {url}/models` on every backend this often; 0 turns them off.
    probe_interval: Annotated[float, BeforeValidator(parse_duration_s), Field(ge=0.0)] = 10.0
    circuit: CircuitSpec = CircuitSpec()


class Policy(_Frozen):
    storage: Annotated[str, BeforeValidator(setting), AfterValidator(check_storage_url)] = "memory"
    admin_keys: tuple[ClientKey, ...] = ()
    ledger: Annotated[str, BeforeValidator(setting), AfterValidator(_ledger_url)] | None = None
    # Access-log lines carry the prompt and completion text (never keys); off by default.
    log_content: bool = False
    server: ServerSpec = ServerSpec()
    upstream: UpstreamSpec = UpstreamSpec()
    embedder: EmbedderSpec | None = None
    backends: tuple[Backend, ...] = Field(min_length=1)
    models: dict[Name, ModelSpec]
    tenants: dict[TagName, Tenant]

    def backends_for(self, model: str) -> tuple[Backend, ...]:
        return tuple(b for b in self.backends if model in b.models)
