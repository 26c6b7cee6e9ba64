"""Prometheus metrics: GenAI histograms and gateway counters, recorded once per request.

Why not prometheus_client's own Histogram: its `labels(...).observe()` takes a lock per bucket
and costs ~3 µs; a request records ten values. Here each label set's figures are plain lists
(proxy/telemetry/metricstate.py) updated in ~0.2 µs (one event loop thread records and
scrapes, so nothing needs a lock), and a prometheus_client Collector turns them into the text
format on `GET /metrics` only. The registry belongs to one Gateway (built in its lifespan),
never to the module. Under `serve --workers N` a scrape shows every worker's figures summed
(proxy/telemetry/workershare.py); `collect` alone (the OTLP push) is this process's own.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from proxy.telemetry import semconv
from proxy.telemetry.keptmetrics import kept_metrics, outcomes_of
from proxy.telemetry.metricstate import MetricState, counts_of_dead, versions_in
from proxy.telemetry.sample import RequestSample
from proxy.telemetry.workershare import PUBLISH_S, WorkerShare
from proxy.upstream.meter import GapHistogram, gap_bucket_mid_s

if TYPE_CHECKING:
    from proxy.ledger import LedgerStats

__all__ = ["BudgetLeft", "GatewayMetrics"]

_LABELS = ("tenant", "gen_ai_operation_name", "gen_ai_request_model", "backend", "status_class")
# Costs are summed in integer nano-USD and turned into dollars once, as the ledger's are.
_NUSD_PER_USD = 1e9


@dataclass(frozen=True, slots=True)
class BudgetLeft:
    """What is left of one quota of one tenant, read from storage when scraped."""

    tenant: str
    quota: str  # the policy key, e.g. tokens_per_day
    left: float  # tokens, or USD for usd_* quotas


# (attribute of Series, metric name, help): the histograms, in exposition order.
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

    def __init__(self, share: WorkerShare | None = None) -> None:
        self._own = MetricState()  # this process's figures
        self._shown = self._own  # what `collect` renders: the whole server's during a scrape
        self._share = share
        self._publishing = False
        self._budgets: Sequence[BudgetLeft] = ()
        self._ledger: Callable[[], LedgerStats] | None = None
        self._spans: Callable[[], Mapping[str, int]] | None = None
        self._settles: Callable[[], Mapping[str, int]] | None = None
        self._true_ups: Callable[[], Mapping[str, int]] | None = None
        self._gap_spans = _gap_spans(semconv.CHUNK_S)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        ProcessCollector(registry=self.registry)

    def watch_ledger(self, stats: Callable[[], LedgerStats]) -> None:
        """Show the ledger's counters (`stats`, read when the figures are rendered or shared):
        what it wrote, dropped and holds, and its failed writes."""
        self._ledger = stats

    def watch_spans(self, dropped: Callable[[], Mapping[str, int]]) -> None:
        """Show the request spans the OTLP export lost (`dropped`, by why), read as the
        ledger's counters are."""
        self._spans = dropped

    def watch_unbooked(self, stats: Callable[[], Mapping[str, int]]) -> None:
        """Show the quota settles storage did not take (`stats`: kept now, and by outcome),
        read as the ledger's counters are."""
        self._settles = stats

    def watch_true_ups(self, stats: Callable[[], Mapping[str, int]]) -> None:
        """Show the token-bucket true-ups storage did not take (`stats`: kept now, and by
        outcome), read as the ledger's counters are."""
        self._true_ups = stats

    def read_watched(self) -> None:
        """Read the watched counters now (the ledger's, the lost spans'): a scrape, a worker's
        publishing and the OTLP metrics push each do first."""
        own = self._own
        if self._spans is not None:
            own.spans = {(why,): count for why, count in self._spans().items()}
        if self._settles is not None:
            own.settles_pending, own.settles = outcomes_of(self._settles())
        if self._true_ups is not None:
            own.true_ups_pending, own.true_ups = outcomes_of(self._true_ups())
        if self._ledger is None:
            return
        stats = self._ledger()
        own.ledger = {
            ("written",): stats.written,
            ("dropped",): stats.dropped,
            ("write_failures",): stats.write_failures,
        }
        own.ledger_buffered = {(): stats.buffered}

    def publish_last(self) -> None:
        """Under `--workers N`: this worker's last figures, its ledger closed (at its stop;
        not `atexit`, which uvicorn skips: it ends a worker by raising SIGTERM again)."""
        if self._share is not None:
            self.read_watched()
            self._share.publish(self._own.dump())

    def _writes_pending(self) -> bool:
        """Ledger records appended and not yet written or dropped."""
        if self._ledger is None:
            return False
        stats = self._ledger()
        return stats.appended > stats.written + stats.dropped

    def stream_started(self, tenant: str, model: str) -> None:
        inflight = self._own.inflight
        inflight[(tenant, model)] = inflight.get((tenant, model), 0) + 1
        self._changed()

    def stream_ended(self, tenant: str, model: str) -> None:
        self._own.inflight[(tenant, model)] -= 1
        self._changed()

    def record(self, sample: RequestSample) -> None:
        self._own.record(sample, self._gap_spans)
        self._changed()

    def count_rejected(self, tenant: str, model: str, reason: str) -> None:
        """A gateway 429 of a request recorded nowhere else (`count_tokens`)."""
        rejected = self._own.rejected
        rejected[(tenant, model, reason)] = rejected.get((tenant, model, reason), 0) + 1
        self._changed()

    def policy_reloaded(self, result: str) -> None:
        """A policy reload's outcome: `applied`, `refused` (the old policy serves on), `failed`."""
        reloads = self._own.reloads
        reloads[(result,)] = reloads.get((result,), 0) + 1
        self._changed()

    def serving(self, policy_hash: str) -> None:
        """The policy version this process serves now (at startup and after each reload)."""
        self._own.policy = {(policy_hash,): 1}
        self._changed()

    def workers_by_version(self) -> dict[str, int] | None:
        """Under `--workers N`: how many live workers serve each policy version, this one as it
        is and the others as they last published (a change at most `PUBLISH_S` ago may be
        missing); None in one process."""
        if self._share is None:
            return None
        served: dict[str, int] = {}
        versions = [{v for (v,), serving in self._own.policy.items() if serving > 0}]
        versions += [versions_in(d) for d, alive in self._share.others(counts_of_dead) if alive]
        for worker in versions:
            for version in worker:
                served[version] = served.get(version, 0) + 1
        return served

    def _changed(self) -> None:
        """Under `--workers N`: publish this worker's figures soon (once per `PUBLISH_S`)."""
        if self._share is not None and not self._publishing:
            self._publishing = True
            asyncio.get_running_loop().call_later(PUBLISH_S, self._publish)

    def _publish(self) -> bytes:
        self._publishing = False
        self.read_watched()
        if self._writes_pending():
            # Records still to write: publish again once the writer has had its turn, or a
            # worker no scrape reaches (the kernel may hand every new connection to the other)
            # would never show its last requests' ledger counts.
            self._changed()
        dumped = self._own.dump()
        if self._share is not None:
            self._share.publish(dumped)
        return dumped

    def render(self, budgets: Sequence[BudgetLeft] = ()) -> bytes:
        """The Prometheus text format of the whole server (every worker's figures summed);
        `budgets` are the quotas just read from storage."""
        self.use_budgets(budgets)
        if self._share is None:
            self.read_watched()
            return generate_latest(self.registry) + _policy_info(self._own)
        whole = MetricState()
        whole.add(self._publish(), alive=True)
        for dumped, alive in self._share.others(counts_of_dead):
            whole.add(dumped, alive=alive)
        self._shown = whole
        try:
            return generate_latest(self.registry) + _policy_info(whole)
        finally:
            self._shown = self._own

    def use_budgets(self, budgets: Sequence[BudgetLeft]) -> None:
        """The quotas `collect` reports from now on (read from storage by the caller)."""
        self._budgets = budgets

    def collect(self) -> Iterator[Metric]:
        state = self._shown
        yield from self._histograms(state)
        yield _counter(
            "tokenweir_requests", "Requests answered (rejected ones too).", _LABELS,
            ((k, s.requests) for k, s in state.series.items()),
        )  # fmt: skip
        yield _counter(
            "tokenweir_cost_usd", "Cost by the policy's model prices, USD.", _LABELS,
            ((k, s.cost_nusd / _NUSD_PER_USD) for k, s in state.series.items()),
        )  # fmt: skip
        yield _counter(
            "tokenweir_cache_requests", "Requests by cache result: hit, semantic-hit, miss, bypass",
            ("tenant", "gen_ai_request_model", "result"), state.cache.items(),
        )  # fmt: skip
        yield _counter(
            "tokenweir_cache_saved_tokens", "Backend tokens cache hits spared, input and output.",
            ("tenant", "gen_ai_request_model", "gen_ai_token_type"), state.saved_tokens.items(),
        )  # fmt: skip
        yield _counter(
            "tokenweir_cache_saved_usd", "What cache hits spared, USD by the model prices.",
            ("tenant", "gen_ai_request_model"),
            ((k, nusd / _NUSD_PER_USD) for k, nusd in state.saved_nusd.items()),
        )  # fmt: skip
        yield _counter(
            "tokenweir_rejected_requests", "The gateway's own 429s by reason: rate_limit, budget.",
            ("tenant", "gen_ai_request_model", "reason"), state.rejected.items(),
        )  # fmt: skip
        yield _counter(
            "tokenweir_degraded_requests", "Requests a degradation rule changed, by rule.",
            ("tenant", "rule"), state.degraded.items(),
        )  # fmt: skip
        yield _counter(
            "tokenweir_broken_streams",
            "Answers that ended in an error after their 200 (a stream broken off mid-way), "
            "which tokenweir_requests_total counts under status_class 2xx.",
            ("tenant", "gen_ai_request_model", "backend"), state.broken.items(),
        )  # fmt: skip
        yield _counter(
            "tokenweir_policy_reloads",
            "Policy reloads by result: applied, refused (the file has errors or cannot be "
            "applied; the old policy serves on), failed. Each worker counts its own.",
            ("result",), state.reloads.items(),
        )  # fmt: skip
        inflight = GaugeMetricFamily(
            "tokenweir_inflight_streams", "Streams being relayed now.",
            labels=("tenant", "gen_ai_request_model"),
        )  # fmt: skip
        for key, value in state.inflight.items():
            inflight.add_metric(key, value)
        yield inflight
        yield from _ledger_metrics(state)
        yield from kept_metrics(state)
        if state.spans:  # tokenweir's own OTLP span export is on
            yield _counter(*_SPANS_DROPPED, state.spans.items())
        yield from self._budget_gauges()

    def _histograms(self, state: MetricState) -> Iterator[Metric]:
        tokens = HistogramMetricFamily(
            "gen_ai_client_token_usage", "Input and output tokens per request.",
            labels=(*_LABELS, "gen_ai_token_type"),
        )  # fmt: skip
        for key, series in state.series.items():
            for kind, hist in (("input", series.input_tokens), ("output", series.output_tokens)):
                if any(hist.counts):
                    tokens.add_metric((*key, kind), hist.buckets(), hist.sum)
        yield tokens
        for attribute, name, documentation in _HISTOGRAMS:
            family = HistogramMetricFamily(name, documentation, labels=_LABELS)
            for key, series in state.series.items():
                hist = series.histogram(attribute)
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


def _ledger_metrics(state: MetricState) -> Iterator[Metric]:
    """The ledger's counters and its buffer, where the gateway keeps one."""
    if not state.ledger:
        return
    for what, name, documentation in _LEDGER_COUNTERS:
        yield _counter(name, documentation, (), [((), state.ledger.get((what,), 0))])
    buffered = GaugeMetricFamily(
        "tokenweir_ledger_records_buffered", "Usage records not written to the ledger yet."
    )
    buffered.add_metric((), sum(state.ledger_buffered.values()))
    yield buffered


_SPANS_DROPPED = (
    "tokenweir_spans_dropped",
    "Request spans the OTLP export lost: queue_full (OTEL_BSP_MAX_QUEUE_SIZE reached) or "
    "export_failed (the collector did not take them in time).",
    ("reason",),
)

_LEDGER_COUNTERS = (
    ("written", "tokenweir_ledger_records_written", "Usage records written to the ledger."),
    ("dropped", "tokenweir_ledger_records_dropped",
     "Usage records the ledger dropped: its buffer full, or a record it cannot write."),
    ("write_failures", "tokenweir_ledger_write_failures",
     "Ledger writes that failed (retried until the store is back)."),
)  # fmt: skip


def _policy_info(state: MetricState) -> bytes:
    """Which policy versions serve (the first 16 hex digits of the SHA-256 of the file): one
    series each, 1, for every version a live worker serves (two while workers disagree)."""
    lines = [
        b"# HELP tokenweir_policy_info The policy this server serves (hash of its file).\n",
        b"# TYPE tokenweir_policy_info gauge\n",
    ]
    for (policy_hash,), workers in sorted(state.policy.items()):
        if workers > 0:
            lines.append(b'tokenweir_policy_info{hash="' + policy_hash.encode() + b'"} 1.0\n')
    return b"".join(lines)


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
