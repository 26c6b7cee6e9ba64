"""Prometheus metrics of the writes storage did not take when a request ended (Redis full,
read-only, unreachable, slow), each kept in process memory and sent again: quota settles
(stages/unbooked.py) and token-bucket true-ups (stages/trueups.py)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from proxy.telemetry.metricstate import MetricState

__all__ = ["kept_metrics", "outcomes_of"]

_Key = tuple[str, ...]

_SETTLES = (
    "tokenweir_quota_settles_unbooked",
    "Quota settles storage did not take at once, by outcome: uncertain (the failed call may "
    "have run: sent again only while its lease is held, so booked once), booked_late (sent "
    "again and booked), settled_before (sent again, its lease was no longer held: settled by "
    "the first call, or expired), dropped (never booked: over the bound, or at shutdown).",
    "tokenweir_quota_settles_pending",
    "Quota settles kept to send again to storage.",
)
_TRUE_UPS = (
    "tokenweir_token_true_ups_missed",
    "Token-bucket true-ups storage did not take at once, by outcome: trued_late (sent again "
    "and taken), uncertain (the failed call may have run: not sent again, it would count "
    "twice), dropped (never taken: past 10,000 buckets kept, or at shutdown).",
    "tokenweir_token_true_ups_pending",
    "Token buckets with a true-up kept to send again to storage.",
)


def outcomes_of(stats: Mapping[str, int]) -> tuple[dict[_Key, int], dict[_Key, int]]:
    """A keeper's `stats()` as MetricState keeps them: (kept now, by outcome since start)."""
    outcomes: dict[_Key, int] = {(what,): n for what, n in stats.items() if what != "pending"}
    return {(): stats["pending"]}, outcomes


def kept_metrics(state: MetricState) -> Iterator[Metric]:
    """The kept quota settles' and true-ups' counters by outcome, and how many are kept now."""
    yield from _kept(state.settles, state.settles_pending, _SETTLES)
    yield from _kept(state.true_ups, state.true_ups_pending, _TRUE_UPS)


def _kept(
    outcomes: dict[_Key, int], pending: dict[_Key, int], names: tuple[str, str, str, str]
) -> Iterator[Metric]:
    if not outcomes:  # not watched: a gateway without that keeper
        return
    counter_name, counter_help, gauge_name, gauge_help = names
    counter = CounterMetricFamily(counter_name, counter_help, labels=("outcome",))
    for key, value in outcomes.items():
        counter.add_metric(key, value)
    yield counter
    gauge = GaugeMetricFamily(gauge_name, gauge_help)
    gauge.add_metric((), sum(pending.values()))
    yield gauge
