"""Run one concurrency level: N workers share one client and a request quota or deadline."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from proxy.tools.bench.client import (
    EVENTS,
    TOKENIZER,
    UNKNOWN,
    USAGE,
    RequestSample,
    RequestSender,
)
from proxy.tools.bench.config import BenchConfig, chat_completions_url
from proxy.tools.bench.httpx_transport import HttpxTransport
from proxy.tools.bench.prompts import Workload, build_workload, load_tokenizer
from proxy.tools.bench.stats import Summary, summarize, verdict
from proxy.tools.bench.transport import Transport
from proxy.tools.bench.wire import WireTransport

__all__ = ["LevelProgress", "LevelResult", "open_transport", "run_level", "summarize_level"]

PROGRESS_INTERVAL_S = 0.2
# Least exact first: a level's token counts are only as exact as the weakest request's.
_SOURCE_ORDER = (UNKNOWN, EVENTS, TOKENIZER, USAGE)


@dataclass(frozen=True, slots=True)
class LevelResult:
    """Everything measured at one concurrency level; tokens/s are per the `token_source` unit."""

    concurrency: int
    requests: int  # finished, ok or not; only ok ones feed the measures below
    ok: int
    errors: dict[str, int]  # by kind: http_<status>, timeout, connection, stream_error, ...
    error_examples: dict[str, str]  # one detail per kind
    wall_s: float  # level start to the last request's end
    requests_per_s: float  # ok requests / wall_s
    ttft_s: Summary  # request sent -> first content-bearing event
    itl_s: Summary  # gaps between content-bearing events (one token each on most servers)
    stream_tokens_per_s: Summary  # per stream: (tokens - 1) / (last - first content event)
    e2e_s: Summary
    output_tokens: int | None  # None when not counted (token_source unknown), never a 0
    aggregate_tokens_per_s: float | None  # output_tokens / wall_s
    token_source: str  # usage, tokenizer, events (no usage, no tokenizer), or unknown
    client_cpu_fraction: float  # this process's CPU time / wall_s; 1.0 is one core
    verdict: str  # the band of the median per-stream speed


@dataclass(slots=True)
class LevelProgress:
    """Live counters for the progress line; updated once per finished request, never per token."""

    concurrency: int
    planned: int | None
    start_s: float = field(default_factory=time.perf_counter)
    started: int = 0
    finished: int = 0
    failed: int = 0
    output_tokens: int = 0
    uncounted: int = 0  # ok answers without a token count (no usage, no tokenizer)

    def record(self, sample: RequestSample) -> None:
        self.finished += 1
        if sample.error is not None:
            self.failed += 1
        elif sample.output_tokens is None:
            self.uncounted += 1
        else:
            self.output_tokens += sample.output_tokens


@dataclass(slots=True)
class _Dispatch:
    """Hands out request indexes until the quota or the deadline is reached."""

    next_index: int
    stop_index: int | None
    deadline_s: float | None
    progress: LevelProgress

    def take(self) -> int | None:
        if self.stop_index is not None and self.next_index >= self.stop_index:
            return None
        if self.deadline_s is not None and time.perf_counter() >= self.deadline_s:
            return None
        index = self.next_index
        self.next_index += 1
        self.progress.started += 1
        return index


def open_transport(config: BenchConfig, max_connections: int) -> Transport:
    """The transport `config.http_client` names, for the chat endpoint under `base_url`."""
    url = chat_completions_url(config.base_url)
    if config.http_client == "httpx":
        return HttpxTransport(
            url,
            api_key=config.api_key,
            timeout_s=config.timeout_s,
            max_connections=max_connections,
        )
    return WireTransport(url, api_key=config.api_key)


async def run_level(
    config: BenchConfig,
    concurrency: int,
    *,
    workload: Workload | None = None,
    transport: Transport | None = None,
    on_progress: Callable[[LevelProgress], None] | None = None,
    first_request: int = 0,
) -> LevelResult:
    """Keep `concurrency` requests in flight until the level's quota or duration is used up.

    Without `workload` or `transport` they are built from `config` (and the transport closed
    after). `first_request` offsets into the workload so later levels send other prompts.
    """
    if workload is None:
        tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else None
        workload = build_workload(config, tokenizer)
    own_transport = transport is None
    if transport is None:
        transport = open_transport(config, concurrency)
    sender = RequestSender(
        transport, workload.tokenizer, config.timeout_s, max_events=config.max_events
    )
    try:
        return await _measure(config, concurrency, sender, workload, on_progress, first_request)
    finally:
        if own_transport:
            await transport.aclose()


async def _measure(
    config: BenchConfig,
    concurrency: int,
    sender: RequestSender,
    workload: Workload,
    on_progress: Callable[[LevelProgress], None] | None,
    first_request: int,
) -> LevelResult:
    planned = config.requests_for(concurrency)
    progress = LevelProgress(concurrency=concurrency, planned=planned)
    dispatch = _Dispatch(
        next_index=first_request,
        stop_index=None if planned is None else first_request + planned,
        deadline_s=None if config.duration_s is None else progress.start_s + config.duration_s,
        progress=progress,
    )
    samples: list[RequestSample] = []
    bodies = workload.bodies

    async def worker() -> None:
        while (index := dispatch.take()) is not None:
            sample = await sender.send(bodies[index % len(bodies)], stream=config.stream)
            samples.append(sample)
            progress.record(sample)

    cpu_start_s = time.process_time()
    ticker = asyncio.create_task(_tick(progress, on_progress)) if on_progress else None
    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(concurrency):
                group.create_task(worker())
    finally:
        if ticker is not None:
            ticker.cancel()
            await asyncio.wait([ticker])  # unlike `await ticker`, never re-raises its cancel
    end_s = time.perf_counter()
    if on_progress is not None:
        on_progress(progress)
    cpu_fraction = (time.process_time() - cpu_start_s) / max(end_s - progress.start_s, 1e-9)
    return summarize_level(concurrency, samples, progress.start_s, cpu_fraction)


async def _tick(progress: LevelProgress, on_progress: Callable[[LevelProgress], None]) -> None:
    while True:
        await asyncio.sleep(PROGRESS_INTERVAL_S)
        on_progress(progress)


def summarize_level(
    concurrency: int, samples: Sequence[RequestSample], start_s: float, cpu_fraction: float
) -> LevelResult:
    """Fold one level's samples into its result; failed requests count only as errors."""
    ok = [sample for sample in samples if sample.error is None]
    failed = [sample for sample in samples if sample.error is not None]
    wall_s = max((sample.end_s for sample in samples), default=start_s) - start_s
    per_s = 1.0 / wall_s if wall_s > 0 else 0.0
    examples: dict[str, str] = {}
    for sample in failed:
        examples.setdefault(sample.error or "", sample.error_detail or "")
    speeds = [s for sample in ok if (s := sample.stream_tokens_per_s) is not None]
    stream_speed = summarize(speeds)
    sources = {sample.token_source for sample in ok}
    token_source = next((s for s in _SOURCE_ORDER if s in sources), UNKNOWN)
    # A level with any uncounted answer has no token total: a partial sum or a 0 would be wrong.
    counted = token_source != UNKNOWN
    output_tokens = sum(sample.output_tokens or 0 for sample in ok) if counted else None
    return LevelResult(
        concurrency=concurrency,
        requests=len(samples),
        ok=len(ok),
        errors=dict(Counter(sample.error or "" for sample in failed).most_common()),
        error_examples=examples,
        wall_s=wall_s,
        requests_per_s=len(ok) * per_s,
        ttft_s=summarize([t for sample in ok if (t := sample.ttft_s) is not None]),
        itl_s=summarize(list(itertools.chain.from_iterable(sample.gaps_s for sample in ok))),
        stream_tokens_per_s=stream_speed,
        e2e_s=summarize([sample.e2e_s for sample in ok]),
        output_tokens=output_tokens,
        aggregate_tokens_per_s=None if output_tokens is None else output_tokens * per_s,
        token_source=token_source,
        client_cpu_fraction=cpu_fraction,
        verdict=verdict(stream_speed.p50),
    )
