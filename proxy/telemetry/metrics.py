"""Prometheus metrics: GenAI histograms and gateway counters, recorded once per request.

Why not prometheus_client's own Histogram: its `labels(...).observe()` takes a lock per bucket
and costs ~3 µs; a request records ten values. Here each label set's figures are plain lists
updated in ~0.2 µs (one event loop thread records and scrapes, so nothing needs a lock), and
a prometheus_client Collector turns them into the text format on `GET /metrics` only. The
registry belongs to one Gateway (built in its lifespan), never to the module.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from proxy.telemetry import semconv
from proxy.telemetry.sample import Labels, RequestSample
from proxy.upstream.meter import GapHistogram, gap_bucket_mid_s

__all__ = ["BudgetLeft", "GatewayMetrics"]

_LABELS = ("tenant", "gen_ai_operation_name", "gen_ai_request_model", "backend", "status_class")


class _Histogram:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def add_gaps(self, gaps: GapHistogram, spans: Sequence[tuple[int, int]]) -> None:
        """Every gap of a request at once: the meter's fine buckets folded into ours, each of
        ours taking the run of fine buckets `spans[i]` whose middles fall in it."""
        counts, fine = self.counts, gaps.counts
        for i, (start, stop) in enumerate(spans):
            counts[i] += sum(fine[start:stop])
        self.sum += gaps.total_s

    def buckets(self) -> list[tuple[str, float]]:
        out, seen = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            seen += n
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(seen)))
        return out


class _Series:
    """Everything recorded for one label set."""

    __slots__ = (
        "client_duration", "client_tpoc", "client_ttfc", "cost_usd", "input_tokens",
        "output_tokens", "overhead", "requests", "server_duration", "server_tpot", "server_ttft",
    )  # fmt: skip

    def __init__(self) -> None:
        self.requests = 0
        self.cost_usd = 0.0
        self.input_tokens = _Histogram(semconv.TOKENS)
        self.output_tokens = _Histogram(semconv.TOKENS)
        self.client_duration = _Histogram(semconv.DURATION_S)
        self.client_ttfc = _Histogram(semconv.DURATION_S)
        self.client_tpoc = _Histogram(semconv.CHUNK_S)
        self.server_duration = _Histogram(semconv.DURATION_S)
        self.server_ttft = _Histogram(semconv.SERVER_TTFT_S)
        self.server_tpot = _Histogram(semconv.CHUNK_S)
        self.overhead = _Histogram(semconv.OVERHEAD_S)


@dataclass(frozen=True, slots=True)
class BudgetLeft:
    """What is left of one quota of one tenant, read from storage when scraped."""

    tenant: str
    quota: str  # the policy key, e.g. tokens_per_day
    left: float  # tokens, or USD for usd_* quotas


# (attribute of _Series, metric name, help): the histograms, in exposition order.
_HISTOGRAMS = (
    ("client_duration", "gen_ai_client_operation_duration_seconds",
     "Backend call duration: request sent to last byte read."),
    ("client_ttfc", "gen_ai_client_operation_time_to_first_chunk_seconds",
     "Streams: request sent to the backend until its first chunk arrived."),
    ("client_tpoc", "gen_ai_client_operation_time_per_output_chunk_seconds",
     "Streams: every gap between two chunks with generated text."),
    ("server_duration", "gen_ai_server_request_duration_seconds",
     "Request received to last byte written, as the gateway's client saw it."),
    ("server_ttft", "gen_ai_server_time_to_first_token_seconds",
     "Streams: request received to first token written to the client."),
    ("server_tpot", "gen_ai_server_time_per_output_token_seconds",
     "Generation time after the first token per output token (1 / tokens per second)."),
    ("overhead", "tokenweir_gateway_overhead_seconds",
     "Time spent in the gateway's own code for a request."),
)  # fmt: skip


class GatewayMetrics(Collector):
    """Records finished requests; renders them, with budgets and in-flight streams, on demand."""

    def __init__(self) -> None:
        self._series: dict[Labels, _Series] = {}
        self._cache: dict[tuple[str, str, str], int] = {}
        self._saved_tokens: dict[tuple[str, str, str], int] = {}
        self._saved_usd: dict[tuple[str, str], float] = {}
        self._rejected: dict[tuple[str, str, str], int] = {}
        self._degraded: dict[tuple[str, str], int] = {}
        self._inflight: dict[tuple[str, str], int] = {}
        self._budgets: Sequence[BudgetLeft] = ()
        self._gap_spans = _gap_spans(semconv.CHUNK_S)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        ProcessCollector(registry=self.registry)

    def stream_started(self, tenant: str, model: str) -> None:
        key = (tenant, model)
        self._inflight[key] = self._inflight.get(key, 0) + 1

    def stream_ended(self, tenant: str, model: str) -> None:
        self._inflight[(tenant, model)] -= 1

    def record(self, sample: RequestSample) -> None:
        series = self._series.get(sample.labels)
        if series is None:
            series = self._series[sample.labels] = _Series()
        series.requests += 1
        series.cost_usd += sample.cost_usd
        if sample.input_tokens is not None:
            series.input_tokens.observe(sample.input_tokens)
        if sample.output_tokens is not None:
            series.output_tokens.observe(sample.output_tokens)
        series.server_duration.observe(sample.duration_s)
        series.overhead.observe(sample.gateway_s)
        if sample.upstream_s is not None:
            series.client_duration.observe(sample.upstream_s)
        if sample.upstream_ttft_s is not None:
            series.client_ttfc.observe(sample.upstream_ttft_s)
        if sample.ttft_s is not None:
            series.server_ttft.observe(sample.ttft_s)
        if sample.time_per_token_s is not None:
            series.server_tpot.observe(sample.time_per_token_s)
        if sample.gaps is not None:
            series.client_tpoc.add_gaps(sample.gaps, self._gap_spans)
        self._count_outcomes(sample)

    def _count_outcomes(self, sample: RequestSample) -> None:
        tenant, _, model, _, _ = sample.labels
        key = (tenant, model, sample.cache)
        self._cache[key] = self._cache.get(key, 0) + 1
        if sample.saved_tokens != (0, 0):
            for kind, tokens in zip(("input", "output"), sample.saved_tokens, strict=True):
                saved = (tenant, model, kind)
                self._saved_tokens[saved] = self._saved_tokens.get(saved, 0) + tokens
            self._saved_usd[(tenant, model)] = self._saved_usd.get((tenant, model), 0.0) + (
                sample.saved_usd
            )
        if sample.rejected is not None:
            key = (tenant, model, sample.rejected)
            self._rejected[key] = self._rejected.get(key, 0) + 1
        for rule in sample.degraded:
            self._degraded[(tenant, rule)] = self._degraded.get((tenant, rule), 0) + 1

    def render(self, budgets: Sequence[BudgetLeft] = ()) -> bytes:
        """The Prometheus text format; `budgets` are the quotas just read from storage."""
        self.use_budgets(budgets)
        return generate_latest(self.registry)

    def use_budgets(self, budgets: Sequence[BudgetLeft]) -> None:
        """The quotas `collect` reports from now on (read from storage by the caller)."""
        self._budgets = budgets

    def collect(self) -> Iterator[Metric]:
        yield from self._histograms()
        yield _counter(
            "tokenweir_requests", "Requests answered (rejected ones too).", _LABELS,
            ((k, s.requests) for k, s in self._series.items()),
        )  # fmt: skip
        yield _counter(
            "tokenweir_cost_usd", "Cost by the policy's model prices, USD.", _LABELS,
            ((k, s.cost_usd) for k, s in self._series.items()),
        )  # fmt: skip
        yield _counter(
            "tokenweir_cache_requests", "Requests by cache result: hit, semantic-hit, miss, bypass",
            ("tenant", "gen_ai_request_model", "result"), self._cache.items(),
        )  # fmt: skip
        yield _counter(
            "tokenweir_cache_saved_tokens", "Backend tokens cache hits spared, input and output.",
            ("tenant", "gen_ai_request_model", "gen_ai_token_type"), self._saved_tokens.items(),
        )  # fmt: skip
        yield _counter(
            "tokenweir_cache_saved_usd", "What cache hits spared, USD by the model prices.",
            ("tenant", "gen_ai_request_model"), self._saved_usd.items(),
        )  # fmt: skip
        yield _counter(
            "tokenweir_rejected_requests", "429s by reason: rate_limit or budget.",
            ("tenant", "gen_ai_request_model", "reason"), self._rejected.items(),
        )  # fmt: skip
        yield _counter(
            "tokenweir_degraded_requests", "Requests a degradation rule changed, by rule.",
            ("tenant", "rule"), self._degraded.items(),
        )  # fmt: skip
        inflight = GaugeMetricFamily(
            "tokenweir_inflight_streams", "Streams being relayed now (this process).",
            labels=("tenant", "gen_ai_request_model"),
        )  # fmt: skip
        for key, value in self._inflight.items():
            inflight.add_metric(key, value)
        yield inflight
        yield from self._budget_gauges()

    def _histograms(self) -> Iterator[Metric]:
        tokens = HistogramMetricFamily(
            "gen_ai_client_token_usage", "Input and output tokens per request.",
            labels=(*_LABELS, "gen_ai_token_type"),
        )  # fmt: skip
        for key, series in self._series.items():
            for kind, hist in (("input", series.input_tokens), ("output", series.output_tokens)):
                if any(hist.counts):
                    tokens.add_metric((*key, kind), hist.buckets(), hist.sum)
        yield tokens
        for attribute, name, documentation in _HISTOGRAMS:
            family = HistogramMetricFamily(name, documentation, labels=_LABELS)
            for key, series in self._series.items():
                hist = getattr(series, attribute)
                if any(hist.counts):
                    family.add_metric(key, hist.buckets(), hist.sum)
            yield family

    def _budget_gauges(self) -> Iterator[Metric]:
        for unit in ("tokens", "usd"):
            gauge = GaugeMetricFamily(
                f"tokenweir_budget_remaining_{unit}",
                f"What is left of each {unit} quota (policy budget) per tenant.",
                labels=("tenant", "quota"),
            )
            for left in self._budgets:
                if left.quota.startswith(unit):
                    gauge.add_metric((left.tenant, left.quota), left.left)
            yield gauge


def _gap_spans(bounds: Sequence[float]) -> list[tuple[int, int]]:
    """For each bucket of `bounds` (and +Inf), the run of the meter's gap buckets it takes."""
    owner = [bisect_left(bounds, gap_bucket_mid_s(i)) for i in range(len(GapHistogram().counts))]
    return [
        (bisect_left(owner, bucket), bisect_left(owner, bucket + 1))
        for bucket in range(len(bounds) + 1)
    ]


def _counter(
    name: str,
    documentation: str,
    labels: Sequence[str],
    values: Iterable[tuple[Sequence[str], float]],
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=labels)
    for key, value in values:
        family.add_metric(key, value)
    return family
