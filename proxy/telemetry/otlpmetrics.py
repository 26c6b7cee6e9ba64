"""OTLP metrics from the aggregates `/metrics` already keeps: nothing more per request.

The SDK's instruments cost ~60 µs of CPU per request (ten `record()` calls, each hashing an
attribute set). Prometheus recording is always on and keeps every figure per label set, so
every `OTEL_METRIC_EXPORT_INTERVAL` this turns the same families `/metrics` renders into the
SDK's metrics data (cumulative, with the GenAI names and units) and hands it to the SDK's
exporter (OTLP/HTTP or console), in a worker thread. Every series `/metrics` has goes out,
budgets left included; Prometheus label names become OpenTelemetry attribute keys.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client.core import Metric as Family

from proxy import __version__
from proxy.telemetry import semconv
from proxy.telemetry.metrics import BudgetLeft, GatewayMetrics
from proxy.together import cancelled

__all__ = ["MetricsPush", "metrics_data"]

_log = logging.getLogger("tokenweir")

# Prometheus family -> (OpenTelemetry name, unit).
NAMES: dict[str, tuple[str, str]] = {
    "gen_ai_client_token_usage": ("gen_ai.client.token.usage", "{token}"),
    "gen_ai_client_operation_duration_seconds": ("gen_ai.client.operation.duration", "s"),
    "gen_ai_client_operation_time_to_first_chunk_seconds": (
        "gen_ai.client.operation.time_to_first_chunk", "s"),
    "gen_ai_client_operation_time_per_output_chunk_seconds": (
        "gen_ai.client.operation.time_per_output_chunk", "s"),
    "gen_ai_server_request_duration_seconds": ("gen_ai.server.request.duration", "s"),
    "gen_ai_server_time_to_first_token_seconds": ("gen_ai.server.time_to_first_token", "s"),
    "gen_ai_server_time_per_output_token_seconds": ("gen_ai.server.time_per_output_token", "s"),
    "tokenweir_gateway_overhead_seconds": ("tokenweir.gateway.overhead", "s"),
    "tokenweir_requests": ("tokenweir.requests", "{request}"),
    "tokenweir_cost_usd": ("tokenweir.cost", "USD"),
    "tokenweir_cache_requests": ("tokenweir.cache.requests", "{request}"),
    "tokenweir_cache_saved_tokens": ("tokenweir.cache.saved_tokens", "{token}"),
    "tokenweir_cache_saved_usd": ("tokenweir.cache.saved_cost", "USD"),
    "tokenweir_rejected_requests": ("tokenweir.rejected_requests", "{request}"),
    "tokenweir_degraded_requests": ("tokenweir.degraded_requests", "{request}"),
    "tokenweir_broken_streams": ("tokenweir.broken_streams", "{request}"),
    "tokenweir_inflight_streams": ("tokenweir.inflight_streams", "{stream}"),
    "tokenweir_ledger_records_written": ("tokenweir.ledger.records_written", "{record}"),
    "tokenweir_ledger_records_dropped": ("tokenweir.ledger.records_dropped", "{record}"),
    "tokenweir_ledger_write_failures": ("tokenweir.ledger.write_failures", "{write}"),
    "tokenweir_ledger_records_buffered": ("tokenweir.ledger.records_buffered", "{record}"),
    "tokenweir_budget_remaining_tokens": ("tokenweir.budget.remaining_tokens", "{token}"),
    "tokenweir_budget_remaining_usd": ("tokenweir.budget.remaining_cost", "USD"),
    "tokenweir_policy_reloads": ("tokenweir.policy.reloads", "{reload}"),
    "tokenweir_spans_dropped": ("tokenweir.spans.dropped", "{span}"),
    "tokenweir_quota_settles_unbooked": ("tokenweir.quota.settles_unbooked", "{settle}"),
    "tokenweir_quota_settles_pending": ("tokenweir.quota.settles_pending", "{settle}"),
    "tokenweir_token_true_ups_missed": ("tokenweir.token.true_ups_missed", "{true_up}"),
    "tokenweir_token_true_ups_pending": ("tokenweir.token.true_ups_pending", "{bucket}"),
}  # fmt: skip

# Prometheus label -> OpenTelemetry attribute key.
ATTRIBUTES = {
    "tenant": "tokenweir.tenant",
    "gen_ai_operation_name": "gen_ai.operation.name",
    "gen_ai_request_model": "gen_ai.request.model",
    "gen_ai_token_type": "gen_ai.token.type",
    "backend": "tokenweir.backend",
    "status_class": "tokenweir.status_class",
    "result": "tokenweir.cache.result",
    "reason": "tokenweir.reason",
    "rule": "tokenweir.rule",
    "quota": "tokenweir.quota",
    "outcome": "tokenweir.outcome",
}

# Families whose label means something else than ATTRIBUTES says: a reload's `result`.
_FAMILY_ATTRIBUTES = {
    "tokenweir_policy_reloads": ATTRIBUTES | {"result": "tokenweir.reload.result"},
}

_CUMULATIVE = AggregationTemporality.CUMULATIVE


def _attributes(labels: dict[str, str], family: str = "") -> dict[str, str]:
    names = _FAMILY_ATTRIBUTES.get(family, ATTRIBUTES)
    out = {names.get(name, name): value for name, value in labels.items() if name != "le"}
    if "gen_ai.operation.name" in out:
        out["gen_ai.provider.name"] = semconv.PROVIDER
    return out


def _histogram(family: Family, start_ns: int, now_ns: int) -> Histogram:
    """Prometheus' cumulative `le` buckets back into OTLP's per-bucket counts."""
    buckets: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
    sums: dict[tuple[tuple[str, str], ...], float] = {}
    for sample in family.samples:
        key = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
        if sample.name.endswith("_bucket"):
            buckets.setdefault(key, []).append((float(sample.labels["le"]), sample.value))
        elif sample.name.endswith("_sum"):
            sums[key] = sample.value
    points = []
    for key, cumulative in buckets.items():
        cumulative.sort()
        counts = [int(cumulative[0][1])]
        counts += [int(b - a) for (_, a), (_, b) in itertools.pairwise(cumulative)]
        points.append(
            HistogramDataPoint(
                attributes=_attributes(dict(key)), start_time_unix_nano=start_ns,
                time_unix_nano=now_ns, count=int(cumulative[-1][1]), sum=sums.get(key, 0.0),
                bucket_counts=counts, explicit_bounds=[le for le, _ in cumulative[:-1]],
                min=None, max=None,  # type: ignore[arg-type]  # not kept; OTLP makes them optional
            )
        )  # fmt: skip
    return Histogram(data_points=points, aggregation_temporality=_CUMULATIVE)


def _numbers(family: Family, start_ns: int, now_ns: int) -> list[NumberDataPoint]:
    return [
        NumberDataPoint(_attributes(dict(s.labels), family.name), start_ns, now_ns, s.value)
        for s in family.samples
        if not s.name.endswith("_created")
    ]


def metrics_data(
    families: Iterable[Family], resource: Resource, start_ns: int, now_ns: int
) -> MetricsData:
    """The families `/metrics` renders, as one cumulative OTLP batch (empty families left out)."""
    metrics = []
    for family in families:
        name, unit = NAMES.get(family.name, (family.name, ""))
        data: Any
        if family.type == "histogram":
            data = _histogram(family, start_ns, now_ns)
        elif family.type == "counter":
            data = Sum(_numbers(family, start_ns, now_ns), _CUMULATIVE, is_monotonic=True)
        elif family.type == "gauge":
            data = Gauge(_numbers(family, start_ns, now_ns))
        else:
            continue
        if data.data_points:
            metrics.append(Metric(name, family.documentation, unit, data))
    scope = InstrumentationScope("tokenweir", __version__)
    return MetricsData([ResourceMetrics(resource, [ScopeMetrics(scope, metrics, "")], "")])


class MetricsPush:
    """Exports the gateway's aggregates every `interval_s` while the gateway runs, and once
    more when it closes."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        budgets: Callable[[], Awaitable[Sequence[BudgetLeft]]],
        exporter: MetricExporter,
        resource: Resource,
        interval_s: float,
    ) -> None:
        self._metrics = metrics
        self._budgets = budgets
        self._exporter = exporter
        self._resource = resource
        self._interval_s = interval_s
        self._start_ns = time.time_ns()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="tokenweir-otlp-metrics")

    async def push(self) -> None:
        """One export now: the current figures, budgets read from storage first."""
        self._metrics.use_budgets(await self._budgets())
        self._metrics.read_watched()  # the ledger's figures were only as new as a scrape's
        families = list(self._metrics.collect())  # on the loop, which alone updates them
        result = await asyncio.to_thread(self._export, families, time.time_ns())
        if result is not MetricExportResult.SUCCESS:
            _log.warning("OTLP metrics export failed: %s", result.name)

    def _export(self, families: list[Family], now_ns: int) -> MetricExportResult:
        data = metrics_data(families, self._resource, self._start_ns, now_ns)
        return self._exporter.export(data)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.push()
            except Exception:  # an export must never end the loop
                _log.exception("OTLP metrics export failed")

    async def aclose(self) -> None:
        await cancelled([self._task])
        try:
            await self.push()
        finally:
            await asyncio.to_thread(self._exporter.shutdown)
