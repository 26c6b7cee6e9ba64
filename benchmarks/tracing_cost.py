"""What tracing every request costs the gateway in CPU: no tracing, the SDK path, the direct path.

    python benchmarks/tracing_cost.py [--repeats 7] [--loop-requests 20000] [--requests 4000]
                                      [--only loop|serve]

Two measurements, each interleaving the three set-ups (the order rotates every repeat) and
reporting medians over the repeats:
- loop: this process runs the tracing calls of a plain non-stream request, through tokenweir's
  real Telemetry recorder (begin, every stage timed under its real name, the backend call's
  start and end, settling, finish with its attributes), `--loop-requests` times in a tight
  asyncio loop that pauses 2 ms every 32 requests (as a server waits on its sockets; the export
  thread runs then), and reads its own CPU time, every thread's, until the last span has been
  posted to a stand-in collector in another process (benchmarks/otelsink.py). The queue is
  made large enough that no span is dropped. The collector runs as `tokenweir serve` sets
  it (SERVING_GC_THRESHOLDS): tracing's objects cost what they cost a serving gateway. Also
  shown: the loop thread's share alone.
- serve: three `tokenweir serve` processes on the plain policy, in front of one unpaced
  `tokenweir mock-backend`: without OTEL_*, with `TOKENWEIR_TRACE_PATH=sdk` (the SDK's spans
  and batch processor) and with the default direct path, each exporting over OTLP/HTTP to a
  stand-in collector in this process; `tokenweir bench` sends `--requests` non-stream requests
  of 16 tokens, 64 at a time, and the gateway's CPU is read from /proc around each run.
Each set-up's figure is CPU µs per request; tracing's cost is its difference from no tracing.
Results: benchmarks/results/tracing-cost.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from harness import (
    Process,
    bench,
    free_port,
    otel_environment,
    policy_for,
    publish,
    started,
    warm_up,
)
from otelsink import otlp_sink
from starlette.datastructures import Headers

from proxy.apis import output_fields
from proxy.app import SERVING_GC_THRESHOLDS
from proxy.clock import SystemClock
from proxy.context import RequestContext
from proxy.ledger import UsageRecord
from proxy.outgoing import OutgoingRequest
from proxy.policy import Policy, load_policy
from proxy.stages import Stage, Traced
from proxy.telemetry.metrics import GatewayMetrics
from proxy.telemetry.recorder import Telemetry
from proxy.telemetry.sdk import OtelSdk, start_sdk
from proxy.telemetry.tracing import open_tracing
from proxy.upstream.meter import StreamMeter

SETUPS = ("none", "sdk", "direct")
PACE_EVERY, PAUSE_S = 32, 0.002
OTEL = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none"}
# The plain gateway's stages: the span name of each the recorder times (None: not timed).
STAGE_SPANS = (
    None, None, None, "tokenweir.budget.reserve", "tokenweir.rate_limit.admit", None,
    "tokenweir.cache.lookup", None, "tokenweir.backend_limit.admit", None,
)  # fmt: skip
REQUEST_HEADERS = Headers(raw=[
    (b"host", b"127.0.0.1:8080"), (b"authorization", b"Bearer bench-key"),
    (b"content-type", b"application/json"), (b"user-agent", b"OpenAI/Python 1.97.0"),
])  # fmt: skip
TAIL = b'"model":"mock-llm","choices":[{"finish_reason":"length"}],"usage":{}}'


def _stage(span_name: str | None) -> Stage:
    """A stage that does nothing; a timed one never touched storage (the plain policy has no
    quota, limit or cache), so, as in the gateway, it is timed and draws no span."""

    async def run(self: object, ctx: RequestContext) -> None:
        return None

    attributes: dict[str, Any] = {"__call__": run}
    if span_name is not None:
        attributes |= {"span_name": span_name, "given_back_at_settle": True,
                       "touched": lambda self, ctx: False}  # fmt: skip
    return type("Stage", (), attributes)()  # type: ignore[no-any-return]


STAGES = [_stage(name) for name in STAGE_SPANS]


def usage_of(ctx: RequestContext) -> UsageRecord:
    return UsageRecord(
        ts=ctx.received_wall, request_id=ctx.request_id, tenant="bench", model="mock-llm",
        backend="mock", operation="chat", stream=False, status=200, error=None, input_tokens=64,
        output_tokens=16, cost_nusd=12800, cache="bypass", ttft_ms=None, tokens_per_s=None,
        duration_ms=1.2, shaped=(), degraded=(), client_disconnected=False,
    )  # fmt: skip


async def one_request(
    telemetry: Telemetry,
    stages: list[tuple[Stage, Traced | None]],
    policy: Policy,
    clock: SystemClock,
    n: int,
) -> None:
    """The recorder's calls for one non-stream request, in the pipeline's order."""
    now = clock.monotonic()
    arrival = RequestContext(f"req_{n:032x}", "chat", now, clock.wall(), StreamMeter(now),
                             REQUEST_HEADERS)  # fmt: skip
    telemetry.begin(arrival)
    ctx = arrival.admit("bench", policy.tenants["bench"], None)
    body = {"model": "mock-llm", "messages": [], "max_tokens": 16}
    ctx.outgoing = OutgoingRequest(body, "mock-llm", output_fields("chat"))
    for stage, timed in stages:  # as the pipeline runs them
        if timed is not None and ctx.trace is not None:
            await telemetry.traced(ctx, timed)
        else:
            await stage(ctx)
    ctx.backend = policy.backends[0]
    ctx.meter.sending_upstream(clock.monotonic())
    telemetry.upstream_started(ctx)
    ctx.outcome.status, ctx.input_tokens, ctx.output_tokens, ctx.outcome.tail = 200, 64, 16, TAIL
    ctx.meter.read(clock.monotonic())
    telemetry.upstream_ended(ctx, 200, None)
    telemetry.settle_ran(ctx, clock.monotonic())
    telemetry.finish(ctx, usage_of(ctx))


def loop_once(
    telemetry: Telemetry, sdk: OtelSdk | None, policy: Policy, n: int
) -> tuple[float, float]:
    """(process CPU µs, loop thread CPU µs) per request, export included."""
    clock = SystemClock()

    stages = list(zip(STAGES, telemetry.timed_stages(STAGES), strict=True))

    async def run() -> None:
        for i in range(n):
            await one_request(telemetry, stages, policy, clock, i)
            if i % PACE_EVERY == PACE_EVERY - 1:
                await asyncio.sleep(PAUSE_S)  # idle, as a server waits on sockets: export runs

    process, thread = time.process_time(), time.thread_time()
    asyncio.run(run())
    if sdk is not None and sdk.tracer_provider is not None:
        sdk.tracer_provider.force_flush()
    return ((time.process_time() - process) / n * 1e6, (time.thread_time() - thread) / n * 1e6)


def recorder(policy: Policy, sdk: OtelSdk | None) -> Telemetry:
    provider = sdk.tracer_provider if sdk is not None else None
    tracing = open_tracing(provider) if provider is not None else None
    return Telemetry(policy, SystemClock(), GatewayMetrics(), tracing=tracing)


@contextlib.contextmanager
def sink_process() -> Iterator[str]:
    port = free_port()
    here = Path(__file__).parent
    popen = subprocess.Popen([sys.executable, str(here / "otelsink.py"), str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.post(url + "/v1/traces", content=b"").is_success:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the OTLP sink did not start")
            time.sleep(0.1)
        yield url
    finally:
        popen.terminate()
        popen.wait(timeout=10)


def loop_suite(args: argparse.Namespace, policy: Policy) -> dict[str, Any]:
    queue = str(args.loop_requests * 10)  # room for every span: none is dropped
    gc.set_threshold(*SERVING_GC_THRESHOLDS)
    with (
        sink_process() as endpoint,
        otel_environment(
            {**OTEL, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_MAX_QUEUE_SIZE": queue}
        ),
    ):
        sdks = {"none": None,
                "sdk": start_sdk({**os.environ, "TOKENWEIR_TRACE_PATH": "sdk"}),
                "direct": start_sdk({**os.environ, "TOKENWEIR_TRACE_PATH": "direct"})}  # fmt: skip
        telemetry = {name: recorder(policy, sdk) for name, sdk in sdks.items()}
        for name in SETUPS:  # warm: imports, caches, connections
            loop_once(telemetry[name], sdks[name], policy, 500)
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in SETUPS}
        for repeat in range(args.repeats):
            print(f"loop: repeat {repeat + 1} of {args.repeats}", file=sys.stderr, flush=True)
            for name in SETUPS[repeat % 3 :] + SETUPS[: repeat % 3]:
                runs[name].append(
                    loop_once(telemetry[name], sdks[name], policy, args.loop_requests)
                )
        for sdk in sdks.values():
            if sdk is not None:
                sdk.shutdown()
    return summary({name: [p for p, _ in found] for name, found in runs.items()},
                   {name: [t for _, t in found] for name, found in runs.items()})  # fmt: skip


def serve_suite(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    unpaced = ["mock-backend", "--tokens-per-second", "inf"]
    with started(unpaced, "/v1/models", work / "mock.log") as mock, otlp_sink() as (endpoint, _):
        config = ["serve", "--config", str(policy_for(mock.url, work))]
        environs = {"none": {},
                    "sdk": {**OTEL, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
                            "TOKENWEIR_TRACE_PATH": "sdk"},
                    "direct": {**OTEL, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}}  # fmt: skip
        with contextlib.ExitStack() as stack:
            gateways = {name: stack.enter_context(gateway(config, environ, work / f"{name}.log"))
                        for name, environ in environs.items()}  # fmt: skip
            warm_up(*gateways.values())
            runs: dict[str, list[float]] = {name: [] for name in SETUPS}
            for repeat in range(args.repeats):
                print(f"serve: repeat {repeat + 1} of {args.repeats}", file=sys.stderr, flush=True)
                for name in SETUPS[repeat % 3 :] + SETUPS[: repeat % 3]:
                    runs[name].append(cpu_per_request(gateways[name], args.requests))
    return summary(runs)


@contextlib.contextmanager
def gateway(config: list[str], environ: dict[str, str], log: Path) -> Iterator[Process]:
    """`tokenweir serve` with `environ` added to the environment it inherits."""
    with contextlib.ExitStack() as stack:
        with otel_environment(environ):
            process = stack.enter_context(started(config, "/healthz", log))
        yield process


def cpu_per_request(gateway: Process, requests: int) -> float:
    before = gateway.cpu_s()
    done = bench(gateway.url, 64, requests, stream=False, tokens=16)
    if sum(done["errors"].values()):
        raise RuntimeError(f"errors: {done['errors']}")
    return (gateway.cpu_s() - before) / max(1, done["ok"]) * 1e6


def summary(
    runs: dict[str, list[float]], threads: dict[str, list[float]] | None = None
) -> dict[str, Any]:
    """Medians per set-up, and the median of each repeat's difference from no tracing."""
    result: dict[str, Any] = {"runs": runs, "median_us": {}, "added_us": {}}
    for name, values in runs.items():
        result["median_us"][name] = statistics.median(values)
        if name != "none":
            added = [v - base for v, base in zip(values, runs["none"], strict=True)]
            result["added_us"][name] = statistics.median(added)
    if threads is not None:
        result["loop_thread_median_us"] = {n: statistics.median(v) for n, v in threads.items()}
    return result


def markdown(report: dict[str, Any]) -> str:
    lines = [f"Run {report['when']} on {report['machine']}; {report['repeats']} repeats, medians; "
             f"load average before: {report['load_before']}.", ""]  # fmt: skip
    for suite, title in (("loop", "in-process loop over the tracing calls"),
                         ("serve", "real requests through `tokenweir serve`")):  # fmt: skip
        found = report.get(suite)
        if not found:
            continue
        lines += [f"{title}:", "", "| set-up | CPU µs per request | added by tracing (median "
                  "of per-repeat differences) |" + (" loop thread µs |" if suite == "loop" else ""),
                  "|---|---:|---:|" + ("---:|" if suite == "loop" else "")]  # fmt: skip
        for name in SETUPS:
            added = found["added_us"].get(name)
            row = f"| {name} | {found['median_us'][name]:.1f} | "
            row += "-" if added is None else f"{added:+.1f}"
            row += " |"
            if suite == "loop":
                row += f" {found['loop_thread_median_us'][name]:.1f} |"
            lines.append(row)
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--loop-requests", type=int, default=20000)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--only", choices=["loop", "serve"])
    args = parser.parse_args()
    report: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}",
        "repeats": args.repeats, "load_before": f"{os.getloadavg()[0]:.2f}",
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.only in (None, "loop"):
            policy = load_policy(policy_for("http://127.0.0.1:9", work))
            report["loop"] = loop_suite(args, policy)
        if args.only in (None, "serve"):
            report["serve"] = serve_suite(args, work)
    publish("tracing-cost", report, markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
