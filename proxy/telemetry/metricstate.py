"""What the Prometheus metrics hold: per-label-set figures as plain lists and dicts, updated on
the event loop with no lock, and their JSON form, so `serve --workers N` can sum every worker's
(proxy/telemetry/workershare.py).

Each worker's figures only grow, except three gauges, `inflight` (streams relayed now),
`ledger_buffered` (records not written yet) and `policy` (the version it serves): summing
workers adds their counters and histogram buckets, and their gauges only for workers still
alive (a dead worker holds none).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

import orjson

from proxy.telemetry import semconv
from proxy.telemetry.sample import Labels, RequestSample
from proxy.upstream.meter import GapHistogram

__all__ = [
    "HISTOGRAMS",
    "Histogram",
    "MetricState",
    "Series",
    "counts_of_dead",
    "reloads_in",
    "versions_in",
]


class Histogram:
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

    def add(self, counts: Sequence[int], total: float) -> None:
        """Another worker's figures of the same histogram (same bounds: the same code)."""
        mine = self.counts
        for i, n in enumerate(counts):
            mine[i] += n
        self.sum += total

    def buckets(self) -> list[tuple[str, float]]:
        out, seen = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            seen += n
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(seen)))
        return out


# The histograms of a Series, in exposition (and JSON) order.
HISTOGRAMS = (
    "input_tokens", "output_tokens", "client_duration", "client_ttfc", "client_tpoc",
    "server_duration", "server_ttft", "server_tpot", "overhead",
)  # fmt: skip


class Series:
    """Everything recorded for one label set."""

    __slots__ = ("cost_nusd", "requests", *HISTOGRAMS)

    def __init__(self) -> None:
        self.requests = 0
        # Nano-USD, an integer: a float sum of every request's dollars drifts from the ledger's.
        self.cost_nusd = 0
        self.input_tokens = Histogram(semconv.TOKENS)
        self.output_tokens = Histogram(semconv.TOKENS)
        self.client_duration = Histogram(semconv.DURATION_S)
        self.client_ttfc = Histogram(semconv.DURATION_S)
        self.client_tpoc = Histogram(semconv.CHUNK_S)
        self.server_duration = Histogram(semconv.DURATION_S)
        self.server_ttft = Histogram(semconv.SERVER_TTFT_S)
        self.server_tpot = Histogram(semconv.CHUNK_S)
        self.overhead = Histogram(semconv.OVERHEAD_S)

    def histogram(self, name: str) -> Histogram:
        hist: Histogram = getattr(self, name)
        return hist


_Key = tuple[str, ...]


class MetricState:
    """One process's figures (or the sum of several processes')."""

    __slots__ = (
        "broken", "cache", "degraded", "inflight", "ledger", "ledger_buffered", "policy",
        "rejected", "reloads", "saved_nusd", "saved_tokens", "series", "settles",
        "settles_pending", "spans", "true_ups", "true_ups_pending",
    )  # fmt: skip

    def __init__(self) -> None:
        self.series: dict[Labels, Series] = {}
        self.cache: dict[_Key, int] = {}  # (tenant, model, result)
        self.saved_tokens: dict[_Key, int] = {}  # (tenant, model, token type)
        self.saved_nusd: dict[_Key, int] = {}  # (tenant, model)
        self.rejected: dict[_Key, int] = {}  # (tenant, model, reason)
        self.degraded: dict[_Key, int] = {}  # (tenant, rule)
        self.broken: dict[_Key, int] = {}  # (tenant, model, backend): errors after a 200
        self.inflight: dict[_Key, int] = {}  # (tenant, model)
        self.ledger: dict[_Key, int] = {}  # (what,): the ledger's records written, dropped, ...
        self.ledger_buffered: dict[_Key, int] = {}  # (): its records not written yet
        self.reloads: dict[_Key, int] = {}  # (result,): policy reloads applied, refused, failed
        self.policy: dict[_Key, int] = {}  # (hash,): 1 for the policy version this one serves
        self.spans: dict[_Key, int] = {}  # (reason,): request spans the OTLP export lost
        self.settles: dict[_Key, int] = {}  # (outcome,): quota settles storage did not take
        self.settles_pending: dict[_Key, int] = {}  # (): those kept to send again
        self.true_ups: dict[_Key, int] = {}  # (outcome,): token true-ups storage did not take
        self.true_ups_pending: dict[_Key, int] = {}  # (): buckets with one kept to send again

    def record(self, sample: RequestSample, gap_spans: Sequence[tuple[int, int]]) -> None:
        series = self.series.get(sample.labels)
        if series is None:
            series = self.series[sample.labels] = Series()
        series.requests += 1
        series.cost_nusd += sample.cost_nusd
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
            series.client_tpoc.add_gaps(sample.gaps, gap_spans)
        self._count_outcomes(sample)

    def _count_outcomes(self, sample: RequestSample) -> None:
        tenant, _, model, backend, status = sample.labels
        if status == "2xx" and sample.error_type is not None:  # broken off after its 200
            key = (tenant, model, backend)
            self.broken[key] = self.broken.get(key, 0) + 1
        key = (tenant, model, sample.cache)
        self.cache[key] = self.cache.get(key, 0) + 1
        if sample.saved_tokens != (0, 0):
            for kind, tokens in zip(("input", "output"), sample.saved_tokens, strict=True):
                saved = (tenant, model, kind)
                self.saved_tokens[saved] = self.saved_tokens.get(saved, 0) + tokens
            spared = (tenant, model)
            self.saved_nusd[spared] = self.saved_nusd.get(spared, 0) + sample.saved_nusd
        if sample.rejected is not None:
            key = (tenant, model, sample.rejected)
            self.rejected[key] = self.rejected.get(key, 0) + 1
        for rule in sample.degraded:
            self.degraded[(tenant, rule)] = self.degraded.get((tenant, rule), 0) + 1

    def dump(self) -> bytes:
        """The JSON form `load` reads back (label tuples as lists)."""
        series = [
            [
                list(labels), s.requests, s.cost_nusd,
                [[s.histogram(h).counts, s.histogram(h).sum] for h in HISTOGRAMS],
            ]
            for labels, s in self.series.items()
        ]  # fmt: skip
        counters = {name: list(getattr(self, name).items()) for name in _COUNTERS}
        gauges = {name: list(getattr(self, name).items()) for name in _GAUGES}
        return orjson.dumps({"series": series, **counters, **gauges})

    def add(self, dumped: bytes, *, alive: bool) -> None:
        """Add another process's `dump()`: counters and histograms always, its in-flight
        streams only while it is `alive`."""
        data: dict[str, Any] = orjson.loads(dumped)
        for labels, requests, cost, hists in data["series"]:
            key: Labels = tuple(labels)
            series = self.series.get(key)
            if series is None:
                series = self.series[key] = Series()
            series.requests += requests
            series.cost_nusd += cost
            for name, (counts, total) in zip(HISTOGRAMS, hists, strict=True):
                series.histogram(name).add(counts, total)
        for name in (*_COUNTERS, *_GAUGES) if alive else _COUNTERS:
            mine: dict[_Key, Any] = getattr(self, name)
            for labels, value in data.get(name, ()):  # a worker of an older version: none
                key2 = tuple(labels)
                mine[key2] = mine.get(key2, 0) + value


def counts_of_dead(dumps: Sequence[bytes]) -> bytes:
    """The counters and histograms of workers no longer alive, summed as one `dump()`."""
    state = MetricState()
    for dumped in dumps:
        state.add(dumped, alive=False)
    return state.dump()


def versions_in(dumped: bytes) -> set[str]:
    """The policy versions a process's `dump()` says it serves (one; none from an older one)."""
    policy: list[list[Any]] = orjson.loads(dumped).get("policy", [])
    return {labels[0] for labels, serving in policy if serving > 0}


def reloads_in(dumped: bytes) -> int:
    """The policy reloads a process's `dump()` counts (applied, refused and failed)."""
    reloads: list[list[Any]] = orjson.loads(dumped).get("reloads", [])
    return sum(int(count) for _, count in reloads)


_COUNTERS = (
    "cache", "saved_tokens", "saved_nusd", "rejected", "degraded", "broken", "ledger", "reloads",
    "spans", "settles", "true_ups",
)  # fmt: skip
_GAUGES = (
    "inflight",
    "ledger_buffered",
    "policy",
    "settles_pending",
    "true_ups_pending",
)  # a dead worker's are not summed
