"""Gateway overhead: the same load direct to the simulated backend and through tokenweir, one run.

    python benchmarks/overhead.py [--repeats 3] [--levels 1,16,64,256] [--tokens 256] [--tps 750]
                                  [--features off|all|telemetry|telemetry-sampled]
                                  [--workers N] [--skip-memory]
                                  [--ledger sqlite|redis] [--tokenizer qwen|o200k]

Starts `tokenweir mock-backend` (paced) and a second, unpaced one for non-stream saturation,
`tokenweir serve` (one process, access log on) in front of each, and drives them with
`tokenweir bench`. For every level it alternates direct and gateway runs, reads the gateway's CPU
time from /proc around each gateway run, and reports medians over the repeats. Nothing is pinned:
the gateway shares the machine's cores with the load generator and the backend, as the issue asks.
`--features all` turns on everything built so far in the gateway: a real tokenizer (Qwen2.5,
from ../shared), the whole budget card with daily token and USD quotas, requests/tokens per
minute and max_concurrent, all on a private Redis, a SQLite ledger, the exact response cache on
the same Redis (temperature 0, so every request is looked up and stored; bench's prompts differ,
so all miss), and the telemetry of `--features telemetry`: the plain gateway with tracing and
OTLP metrics exported (OTLP/HTTP to a stand-in collector in this process) and `/metrics` scraped
every 5 s. `--features telemetry-sampled` is that with the standard ratio sampler keeping one
trace in ten (OTLP metrics and /metrics unchanged). `--workers N` runs `tokenweir serve --workers N`
(it needs shared storage, so `--features all`); the gateway's CPU and RSS are then summed over
its process tree. `--skip-memory` leaves out the 1,000-open-streams level. With `--features all`,
`--ledger redis` writes the ledger to the same Redis instead of SQLite and `--tokenizer o200k`
counts with tiktoken's o200k_base (../shared's file) instead of Qwen2.5: both together are the
"all on" of issue 16's text.
Results: benchmarks/results/overhead[-all|-telemetry|-telemetry-sampled][-redis-ledger][-o200k]
.{json,md}; benchmarks/run.py puts the first four into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from budgets import FULL_BUDGET, QWEN, offline_o200k
from harness import (
    RESULTS,
    Process,
    Samples,
    bench,
    bench_command,
    cell,
    policy_for,
    publish,
    started,
    table,
    warm_up,
)
from otelsink import otlp_sink, scraping

from tests.redis_server import private_redis

# Traces and metrics both exported; the SDK's defaults otherwise (batching, sampling: all).
TELEMETRY_ENV = {
    "OTEL_TRACES_EXPORTER": "otlp",
    "OTEL_METRICS_EXPORTER": "otlp",
    "OTEL_METRIC_EXPORT_INTERVAL": "5000",
}

# `--features telemetry-sampled`: the same, with one trace in ten kept (the standard sampler).
TELEMETRY = {
    "telemetry": TELEMETRY_ENV,
    "telemetry-sampled": {
        **TELEMETRY_ENV,
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.1",
    },
}

# Temperature 0 makes every request cacheable: each one is looked up and its answer stored
# (bench's prompts are all different, so every lookup misses: the cost, not the savings).
ALL_BUDGET = FULL_BUDGET.replace("temperature: 0.3", "temperature: 0")

# Generous enough never to refuse the benchmark's load: the cost of checking is what is measured.
ALL_LIMITS = (
    "{requests_per_minute: 100000000, tokens_per_minute: 10000000000, max_concurrent: 5000}"
)


def stream_level(
    mock: Process, gateway: Process, concurrency: int, repeats: int, tokens: int
) -> dict[str, float | None]:
    requests = max(16, 4 * concurrency) if concurrency < 256 else 2 * concurrency
    samples = Samples()
    for _ in range(repeats):
        direct = bench(mock.url, concurrency, requests, stream=True, tokens=tokens)
        cpu_before = gateway.cpu_s()
        through = bench(gateway.url, concurrency, requests, stream=True, tokens=tokens)
        cpu_s = gateway.cpu_s() - cpu_before
        for name, level in (("direct", direct), ("gateway", through)):
            samples.add(f"{name}_ttft_p50", level["ttft_s"]["p50"])
            samples.add(f"{name}_ttft_p99", level["ttft_s"]["p99"])
            samples.add(f"{name}_stream_tps", level["stream_tokens_per_s"]["p50"])
            samples.add(f"{name}_aggregate_tps", level["aggregate_tokens_per_s"])
            samples.add(f"{name}_client_cpu", level["client_cpu_fraction"])
            samples.add(f"{name}_errors", float(sum(level["errors"].values())))
        samples.add("added_ttft_p50", _diff(through["ttft_s"]["p50"], direct["ttft_s"]["p50"]))
        samples.add("added_ttft_p99", _diff(through["ttft_s"]["p99"], direct["ttft_s"]["p99"]))
        samples.add(
            "stream_tps_ratio",
            _ratio(through["stream_tokens_per_s"]["p50"], direct["stream_tokens_per_s"]["p50"]),
        )
        samples.add(
            "aggregate_ratio",
            _ratio(through["aggregate_tokens_per_s"], direct["aggregate_tokens_per_s"]),
        )
        if through["output_tokens"]:
            samples.add("gateway_cpu_us_per_token", cpu_s / through["output_tokens"] * 1e6)
    result = {name: samples.median(name) for name in samples.values}
    result.update(gateway.memory_mb())
    return result


def open_streams_memory(gateway: Process, streams: int, tokens: int) -> dict[str, float]:
    """The gateway's RSS while `streams` slow streams are open through it at once."""
    before = gateway.memory_mb()["rss_mb"]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = bench_command(
            gateway.url, streams, streams, stream=True, tokens=tokens, out=out.name
        )
        load = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        peak = before
        while load.poll() is None:
            peak = max(peak, gateway.memory_mb()["rss_mb"])
            time.sleep(0.25)
        level = json.loads(Path(out.name).read_text())["levels"][0]
    return {
        "streams": streams,
        "ok": level["ok"],
        "rss_before_mb": before,
        "rss_with_streams_open_mb": peak,
        "per_stream_kb": (peak - before) * 1024 / streams,
    }


def non_stream_level(mock: Process, gateway: Process, repeats: int) -> dict[str, float | None]:
    samples = Samples()
    for _ in range(repeats):
        direct = bench(mock.url, 64, 3000, stream=False, tokens=16)
        cpu_before = gateway.cpu_s()
        through = bench(gateway.url, 64, 3000, stream=False, tokens=16)
        cpu_s = gateway.cpu_s() - cpu_before
        samples.add("direct_rps", direct["requests_per_s"])
        samples.add("gateway_rps", through["requests_per_s"])
        samples.add("rps_ratio", _ratio(through["requests_per_s"], direct["requests_per_s"]))
        samples.add("gateway_cpu_us_per_request", cpu_s / max(1, through["ok"]) * 1e6)
        samples.add("gateway_client_cpu", through["client_cpu_fraction"])
        samples.add("errors", float(sum(through["errors"].values())))
    result = {name: samples.median(name) for name in samples.values}
    result.update(gateway.memory_mb())
    return result


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


STREAM_COLUMNS = (
    ("streams", None, 0),
    ("added TTFT p50 ms", "added_ttft_p50", -2),
    ("added TTFT p99 ms", "added_ttft_p99", -2),
    ("per-stream tok/s direct", "direct_stream_tps", 0),
    ("via gateway", "gateway_stream_tps", 0),
    ("ratio", "stream_tps_ratio", 3),
    ("aggregate tok/s direct", "direct_aggregate_tps", 0),
    ("via gateway", "gateway_aggregate_tps", 0),
    ("gateway CPU µs/token", "gateway_cpu_us_per_token", 1),
    ("bench CPU direct", "direct_client_cpu", 2),
    ("bench CPU via gateway", "gateway_client_cpu", 2),
    ("gateway RSS MB", "rss_mb", 0),
)
NON_STREAM_COLUMNS = (
    ("direct req/s", "direct_rps", 0),
    ("via gateway req/s", "gateway_rps", 0),
    ("ratio", "rps_ratio", 3),
    ("gateway CPU µs/request", "gateway_cpu_us_per_request", 0),
    ("bench CPU via gateway", "gateway_client_cpu", 2),
    ("gateway peak RSS MB", "peak_rss_mb", 0),
    ("errors", "errors", 0),
)


def markdown(report: dict[str, Any]) -> str:
    rows = [
        [str(level), *(cell(row.get(key), digits) for _, key, digits in STREAM_COLUMNS[1:] if key)]
        for level, row in report["stream"].items()
    ]
    ns = report["non_stream"]
    features = report.get("features", "off")
    features = f"all on ({all_on_choice(report)})" if features == "all" else features
    lines = [
        f"Run {report['when']} on {report['machine']}; {report['repeats']} repeats, medians; "
        f"{report['tokens']} tokens per stream at {report['tps']} tokens/s per stream; "
        f"gateway features: {features}; "
        f"gateway workers: {report.get('workers', 1)}.",
        "",
        *table(STREAM_COLUMNS, rows),
        "",
        "Non-stream, 64 concurrent requests of 16 tokens, unpaced backend:",
        "",
        *table(
            NON_STREAM_COLUMNS, [[cell(ns.get(key), d) for _, key, d in NON_STREAM_COLUMNS if key]]
        ),
    ]
    memory = report.get("memory")
    if memory is None:
        return "\n".join(lines) + "\n"
    lines += [
        "",
        f"Memory: {memory['streams']} streams open at once through the gateway "
        f"({memory['ok']} completed): RSS {memory['rss_before_mb']:.0f} MB before, "
        f"{memory['rss_with_streams_open_mb']:.0f} MB with them open "
        f"({memory['per_stream_kb']:.0f} KB per open stream).",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--levels", default="1,16,64,256")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--tps", type=float, default=750.0)
    parser.add_argument("--open-streams", type=int, default=1000)
    parser.add_argument("--features", choices=["off", "all", *TELEMETRY], default="off")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--ledger", choices=["sqlite", "redis"], default="sqlite")
    parser.add_argument("--tokenizer", choices=["qwen", "o200k"], default="qwen")
    args = parser.parse_args()
    if args.workers > 1 and args.features != "all":
        parser.error("--workers N needs shared storage: use it with --features all")
    if (args.ledger, args.tokenizer) != ("sqlite", "qwen") and args.features != "all":
        parser.error("--ledger and --tokenizer choose parts of --features all")
    with contextlib.ExitStack() as stack:
        redis_url = stack.enter_context(private_redis()) if args.features == "all" else None
        if args.features != "off":
            endpoint, sink = stack.enter_context(otlp_sink())
            os.environ.update(TELEMETRY.get(args.features, TELEMETRY_ENV))
            os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
        report = run_suite(args, redis_url)
        if args.features != "off":
            report["otlp_exports_received"] = sink.received  # type: ignore[attr-defined]
    suffix = "" if args.features == "off" else f"-{args.features}"
    suffix += f"-workers{args.workers}" if args.workers > 1 else ""
    suffix += "-redis-ledger" if args.ledger == "redis" else ""
    suffix += "-o200k" if args.tokenizer == "o200k" else ""
    publish(f"overhead{suffix}", report, markdown(report))
    return 0


def all_on_parts(work: Path, redis_url: str, ledger: str, tokenizer: str) -> tuple[str, str]:
    """`--features all`'s ledger URL and tokenizer spec, as `--ledger` and `--tokenizer` chose."""
    ledger_url = redis_url if ledger == "redis" else f"sqlite:///{work / 'ledger.db'}"
    return ledger_url, str(QWEN) if tokenizer == "qwen" else offline_o200k(work)


def all_on_choice(report: dict[str, Any]) -> str:
    """Which ledger and which tokenizer a report's `--features all` ran with."""
    tokenizer = "Qwen2.5" if report.get("tokenizer", "qwen") == "qwen" else "o200k"
    return f"{report.get('ledger', 'sqlite')} ledger, {tokenizer} tokenizer"


def gateway_config(
    mock_url: str, work: Path, redis_url: str | None, *, ledger: str = "sqlite",
    tokenizer: str = "qwen",
) -> Path:  # fmt: skip
    """The plain gateway, or (with Redis) every feature built so far."""
    if redis_url is None:
        return policy_for(mock_url, work)
    ledger_url, spec = all_on_parts(work, redis_url, ledger, tokenizer)
    return policy_for(
        mock_url, work, name="all", tokenizer=spec, budget=ALL_BUDGET, limits=ALL_LIMITS,
        storage=redis_url, ledger=ledger_url, cache="{mode: exact}",
    )  # fmt: skip


def run_suite(args: argparse.Namespace, redis_url: str | None) -> dict[str, Any]:
    RESULTS.mkdir(exist_ok=True)
    report: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}",
        "repeats": args.repeats, "tokens": args.tokens, "tps": args.tps, "stream": {},
        "features": args.features, "workers": args.workers,
        "ledger": args.ledger, "tokenizer": args.tokenizer,
    }  # fmt: skip
    workers = ["--workers", str(args.workers)] if args.workers > 1 else []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)

        def config(mock_url: str) -> str:
            parts = {"ledger": args.ledger, "tokenizer": args.tokenizer}
            return str(gateway_config(mock_url, work, redis_url, **parts))

        paced = ["mock-backend", "--tokens-per-second", str(args.tps)]
        with started(paced, "/v1/models", work / "mock.log") as mock:
            serve = ["serve", "--config", config(mock.url), *workers]
            with (
                started(serve, "/healthz", work / "gateway.log") as gateway,
                scraping(gateway.url, args.features != "off"),
            ):
                warm_up(mock, gateway)
                for level in (int(x) for x in args.levels.split(",")):
                    print(f"streams: {level} ...", file=sys.stderr, flush=True)
                    report["stream"][level] = stream_level(
                        mock, gateway, level, args.repeats, args.tokens
                    )
        unpaced = ["mock-backend", "--tokens-per-second", "inf"]
        with started(unpaced, "/v1/models", work / "mock2.log") as mock:
            serve = ["serve", "--config", config(mock.url), *workers]
            with (
                started(serve, "/healthz", work / "gateway2.log") as gateway,
                scraping(gateway.url, args.features != "off"),
            ):
                print("non-stream saturation ...", file=sys.stderr, flush=True)
                warm_up(mock, gateway)
                report["non_stream"] = non_stream_level(mock, gateway, args.repeats)
        if args.skip_memory:
            return report
        slow = ["mock-backend", "--tokens-per-second", "20"]
        with started(slow, "/v1/models", work / "mock3.log") as mock:
            serve = ["serve", "--config", config(mock.url), *workers]
            with started(serve, "/healthz", work / "gateway3.log") as gateway:
                print(f"{args.open_streams} open streams ...", file=sys.stderr, flush=True)
                warm_up(gateway)
                report["memory"] = open_streams_memory(gateway, args.open_streams, tokens=100)
    return report


if __name__ == "__main__":
    sys.exit(main())
