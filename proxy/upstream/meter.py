"""The stream meter: TTFT, inter-token gaps, tokens/s and gateway time, in few clock reads."""

from __future__ import annotations

import math
from bisect import bisect_right
from itertools import pairwise

from proxy.telemetry.semconv import CHUNK_S

__all__ = ["GapHistogram", "StreamMeter", "gap_bucket_mid_s"]

# Log-spaced gap buckets from 50 µs to ~100 s: quantiles within ~12% without keeping every gap,
# split where a time-per-chunk histogram has a boundary.
_BUCKET_BASE_S = 50e-6
_BUCKETS_PER_DOUBLING = 6
_BUCKET_COUNT = 21 * _BUCKETS_PER_DOUBLING
_LOG2 = math.log(2.0)


def _bucket_by_log(gap_s: float) -> int:
    """A gap's bucket, by definition: 0 up to the base, then six a doubling, the last open."""
    if gap_s <= _BUCKET_BASE_S:
        return 0
    index = int(math.log(gap_s / _BUCKET_BASE_S) / _LOG2 * _BUCKETS_PER_DOUBLING) + 1
    return min(index, _BUCKET_COUNT - 1)


def _lowest_in(bucket: int) -> float:
    """The smallest gap `_bucket_by_log` puts in `bucket` or above: found near its nominal
    start by stepping a float at a time, so that the table below agrees with it exactly."""
    gap_s: float = _BUCKET_BASE_S * 2.0 ** ((bucket - 1) / _BUCKETS_PER_DOUBLING)
    while _bucket_by_log(gap_s) >= bucket:
        gap_s = math.nextafter(gap_s, 0.0)
    while _bucket_by_log(gap_s) < bucket:
        gap_s = math.nextafter(gap_s, math.inf)
    return gap_s


# Where each bucket after the first begins: a gap's bucket is how many of these it reaches
# (`bisect_right`, one call in C a token instead of a logarithm and four operations). The
# time-per-chunk histograms' boundaries are starts too, each just above its bound (a bound's
# `le` takes a gap equal to it), so no bucket straddles one of them and folding buckets into
# those histograms puts every gap where its own value belongs (a log bucket across 2.5 s put
# gaps of 2.5-2.6 s under `le="2.5"`).
_BUCKET_STARTS = tuple(
    sorted(
        {_lowest_in(bucket) for bucket in range(1, _BUCKET_COUNT)}
        | {math.nextafter(bound, math.inf) for bound in CHUNK_S}
    )
)
# Each bucket's geometric middle (the first's is the base; the last, open one's is taken a
# twelfth of a doubling above its start, as if a log bucket).
_BUCKET_MIDS: tuple[float, ...] = (
    _BUCKET_BASE_S,
    *(math.sqrt(low * high) for low, high in pairwise(_BUCKET_STARTS)),
    _BUCKET_STARTS[-1] * 2.0 ** (0.5 / _BUCKETS_PER_DOUBLING),
)


class GapHistogram:
    """Counts of inter-token gaps in fixed log-spaced buckets; nothing allocated per gap."""

    __slots__ = ("count", "counts", "max_s", "total_s")

    def __init__(self) -> None:
        self.counts = [0] * len(_BUCKET_MIDS)
        self.count = 0
        self.total_s = 0.0
        self.max_s = 0.0

    def add(self, gap_s: float) -> None:
        self.count += 1
        self.total_s += gap_s
        if gap_s > self.max_s:
            self.max_s = gap_s
        self.counts[bisect_right(_BUCKET_STARTS, gap_s)] += 1

    def quantile_s(self, q: float) -> float | None:
        """The gap below which a fraction `q` of gaps fall (bucket midpoint), None if no gaps."""
        if self.count == 0:
            return None
        rank = max(1, math.ceil(q * self.count))
        seen = 0
        for index, n in enumerate(self.counts):
            seen += n
            if seen >= rank:
                return min(gap_bucket_mid_s(index), self.max_s)
        return self.max_s


def gap_bucket_mid_s(index: int) -> float:
    """The geometric middle of gap bucket `index` (for re-bucketing into other histograms)."""
    return _BUCKET_MIDS[index]


class StreamMeter:
    """Times one response from the moment the request arrived to its last byte.

    `read(now)` when an upstream chunk arrives, `wrote(now, tokens, texted)` once it is written
    to the client; gateway time is the stages before the upstream call (less its waits on others)
    plus, per chunk, read -> written. TTFT, the gaps and tokens/s are timed on a stream's chunks
    with generated text only.
    """

    __slots__ = (
        "attempt_sent_s",
        "client_slow_s",
        "first_token_s",
        "gaps",
        "gateway_s",
        "last_read_s",
        "last_token_s",
        "received_s",
        "texted_events",
        "textless_at_end",
        "token_events",
        "upstream_first_byte_s",
        "upstream_sent_s",
        "waited_s",
    )

    def __init__(self, received_s: float) -> None:
        self.received_s = received_s
        self.upstream_sent_s: float | None = None
        self.attempt_sent_s: float | None = None  # to the backend that answers: the last tried
        self.upstream_first_byte_s: float | None = None
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.token_events = 0
        self.texted_events = 0  # token events in the chunks with generated text
        # Of those, the events without text in the stream's last two chunks (its finish beside
        # its last token): counted once, when the stream ends whole.
        self.textless_at_end = 0
        self.gateway_s = 0.0
        # Waited on the client's body or in the tenant's line: the request's time, not ours.
        self.waited_s = 0.0
        self.client_slow_s = 0.0  # the relay waited this long for the client to read
        self.gaps = GapHistogram()
        self.last_read_s = 0.0  # meaningful once upstream_first_byte_s is set

    def waited(self, wait_s: float) -> None:
        """The request waited `wait_s` on others: for the rest of its body from the client, or
        in the tenant's line for a concurrency slot (`queue_timeout`). In its TTFT and duration,
        as the client saw them, but no time of the gateway's own."""
        self.waited_s += wait_s

    def client_was_slow(self, wait_s: float) -> None:
        """A chunk waited `wait_s` for the client to read (its socket full) before it could be
        written: in the gaps and duration, as the client read them, but not the gateway's."""
        self.gateway_s -= wait_s
        self.client_slow_s += wait_s

    def sending_upstream(self, now: float) -> None:
        self.upstream_sent_s = self.attempt_sent_s = now
        self.gateway_s += now - self.received_s - self.waited_s

    def attempting(self, now: float) -> None:
        """The request goes to a backend now (another after one failed before its first byte):
        the backend's own figures count from here, not from the first attempt."""
        self.attempt_sent_s = now

    def read(self, now: float) -> None:
        if self.upstream_first_byte_s is None:
            self.upstream_first_byte_s = now
        self.last_read_s = now

    def wrote(self, now: float, token_events: int, texted: bool) -> None:
        """A chunk has reached the client: `token_events` of its events count toward the bill's
        estimate (`token_events`), and `texted` if one carries generated text. Only those are
        timed: an event without text (a finish, a role, a filter's verdict, empty `choices`) in
        the middle or at the end ends no gap and begins none."""
        self.gateway_s += now - self.last_read_s
        self.token_events += token_events
        if not texted:
            return
        self.texted_events += token_events
        last_s = self.last_token_s
        if last_s is None:
            self.first_token_s = now
        else:
            self.gaps.add(now - last_s)
        self.last_token_s = now

    def answered_locally(self, now: float, *, streamed: bool) -> None:
        """The gateway wrote a whole answer of its own (a cache hit): all of it was gateway time
        (no upstream read to measure from); its first token, if `streamed`, came now."""
        self.last_read_s = self.received_s + self.waited_s
        self.wrote(now, 1, streamed)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.received_s

    @property
    def upstream_ttft_s(self) -> float | None:
        if self.upstream_first_byte_s is None or self.attempt_sent_s is None:
            return None
        return self.upstream_first_byte_s - self.attempt_sent_s

    def tokens_per_s(self, output_tokens: int, choices: int) -> float | None:
        """Generation speed after the first token: (tokens - choices) / (last - first). The
        `choices` of a request (`n`) are generated side by side, their first tokens together:
        none of those is generated after the first."""
        if self.first_token_s is None or self.last_token_s is None or output_tokens <= choices:
            return None
        span_s = self.last_token_s - self.first_token_s
        return (output_tokens - choices) / span_s if span_s > 0 else None
