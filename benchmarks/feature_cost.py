"""What each feature costs a served non-stream request: the all-on gateway with one left out.

    python benchmarks/feature_cost.py [--rounds 3] [--requests 3000] [--only all,-tracing,...]
                                      [--ledger sqlite|redis] [--tokenizer qwen|o200k]
                                      [--stream [--tps 750]]

The instruction counts (instructions.py) add the features one at a time to the bare gateway;
this takes them away one at a time from the whole, and measures CPU time in service, where
each feature's cost includes what it does to the rest (caches, the GIL, the collector).
One private redis-server, the OTLP stand-in collector and the unpaced simulated backend serve
every set-up; each run starts a fresh `tokenweir serve`:

    all          overhead.py --features all (tracing and OTLP metrics exported)
    -tracing     all but the traces (OTLP metrics still exported)
    -telemetry   all but traces and OTLP metrics
    -ledger      all but the ledger
    -cache       all but the exact response cache
    -limits      all but requests and tokens per minute and max_concurrent
    -budget      all but the budget card (its temperature kept, so every answer is cacheable)
    -access-log  all but the JSON access log line (`serve --no-access-log`), which every other
                 set-up writes, bare too
    bare         auth only, memory storage, no telemetry (overhead.py's plain gateway)

`--ledger redis --tokenizer o200k` is issue 16's own "all on", as in overhead.py. Each round
runs every set-up once (the order reversed every other round): 500 requests to warm up, then
`--requests` non-stream requests of 16 tokens, 64 in flight (each run a fresh prompt seed, so
none is answered from the cache), reading the gateway's CPU from /proc around them, its event
loop's thread apart from its others (the ledger's writer, the span exporter). Reports medians
over the rounds: CPU µs a request (loop thread, other threads), requests/s, and what leaving
the feature out saved against `all` (the median of the rounds' differences).
With `--stream` the load is 64 streams of 256 tokens from a backend paced at `--tps` tokens a
second a stream (a token a read, as from a real engine): 128 streams to warm up, then
`--requests` streams (640 unless given), and the figures are CPU µs a streamed token and
tokens/s (the issue's "CPU per streamed token at 64 streams", feature by feature).
Results: benchmarks/results/feature-cost[-stream][-redis-ledger][-o200k].{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import (
    TICKS_PER_S,
    Process,
    bench,
    cell,
    cpu_ticks,
    otel_environment,
    policy_for,
    publish,
    started,
    table,
    warm_up,
)
from otelsink import otlp_sink
from overhead import ALL_BUDGET, ALL_LIMITS, TELEMETRY_ENV, all_on_choice, all_on_parts

from tests.redis_server import private_redis

NO_TELEMETRY = {"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"}
STREAM_TOKENS = 256
STREAMS_A_RUN = 640
SETUPS: dict[str, str] = {
    "all": "every feature on",
    "-tracing": "all but traces",
    "-telemetry": "all but traces and OTLP metrics",
    "-ledger": "all but the ledger",
    "-cache": "all but the exact cache",
    "-limits": "all but the rate limits",
    "-budget": "all but the budget card",
    "-access-log": "all but the access log",
    "bare": "auth only",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--only", default=",".join(SETUPS), help="set-ups, comma-separated")
    parser.add_argument("--ledger", choices=["sqlite", "redis"], default="sqlite")
    parser.add_argument("--tokenizer", choices=["qwen", "o200k"], default="qwen")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--tps", type=float, default=750.0)
    args = parser.parse_args()
    if args.requests is None:
        args.requests = STREAMS_A_RUN if args.stream else 3000
    chosen = args.only.split(",")
    unknown = [name for name in chosen if name not in SETUPS]
    if unknown:
        parser.error(f"unknown set-ups {unknown}; known: {', '.join(SETUPS)}")
    if not args.stream and args.requests > 4096:
        parser.error("--requests above 4096 sends prompts again, which the cache answers")
    report: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}",
        "load": os.getloadavg(), "rounds": args.rounds, "requests": args.requests,
        "ledger": args.ledger, "tokenizer": args.tokenizer, "stream": args.stream,
        "tps": args.tps,
    }  # fmt: skip
    report["runs"] = measure(args, chosen)
    suffix = "-stream" if args.stream else ""
    suffix += "-redis-ledger" if args.ledger == "redis" else ""
    suffix += "-o200k" if args.tokenizer == "o200k" else ""
    publish(f"feature-cost{suffix}", report, markdown(report))
    return 0


def measure(args: argparse.Namespace, chosen: list[str]) -> dict[str, list[dict[str, float]]]:
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in chosen}
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        redis_url = stack.enter_context(private_redis())
        endpoint, _ = stack.enter_context(otlp_sink())
        pace = str(args.tps) if args.stream else "inf"
        mock = stack.enter_context(
            started(["mock-backend", "--tokens-per-second", pace], "/v1/models", work / "m.log")
        )
        setups = setups_for(mock.url, work, redis_url, args, endpoint)
        for index in range(args.rounds):
            for name in chosen if index % 2 == 0 else chosen[::-1]:
                print(f"round {index + 1}: {name}", file=sys.stderr, flush=True)
                policy, environment, options = setups[name]
                with otel_environment(environment):
                    runs[name].append(
                        one_run(mock, policy, work, args.requests, args.stream, options)
                    )
    return runs


def setups_for(
    mock_url: str, work: Path, redis_url: str, args: argparse.Namespace, endpoint: str
) -> dict[str, tuple[Path, dict[str, str], list[str]]]:
    """Each set-up's policy, OTEL_* environment and further `serve` options."""
    ledger_url, spec = all_on_parts(work, redis_url, args.ledger, args.tokenizer)
    whole = {
        "tokenizer": spec, "budget": ALL_BUDGET, "limits": ALL_LIMITS, "storage": redis_url,
        "ledger": ledger_url, "cache": "{mode: exact}",
    }  # fmt: skip

    def all_but(name: str, **left_out: Any) -> Path:
        return policy_for(mock_url, work, name=name, **(whole | left_out))

    telemetry = TELEMETRY_ENV | {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}
    every = all_but("all")
    return {
        "all": (every, telemetry, []),
        "-tracing": (every, telemetry | {"OTEL_TRACES_EXPORTER": "none"}, []),
        "-telemetry": (every, NO_TELEMETRY, []),
        "-ledger": (all_but("no-ledger", ledger=None), telemetry, []),
        "-cache": (all_but("no-cache", cache="{}"), telemetry, []),
        "-limits": (all_but("no-limits", limits="{}"), telemetry, []),
        "-budget": (all_but("no-budget", budget="{temperature: 0}"), telemetry, []),
        "-access-log": (every, telemetry, ["--no-access-log"]),
        "bare": (policy_for(mock_url, work), NO_TELEMETRY, []),
    }


def one_run(
    mock: Process, policy: Path, work: Path, requests: int, stream: bool, options: list[str]
) -> dict[str, float]:
    """CPU µs a request (a streamed token with `stream`), and requests (tokens) a second."""
    tokens = STREAM_TOKENS if stream else 16
    serve = ["serve", "--config", str(policy), *options]
    with started(serve, "/healthz", work / "gateway.log") as gateway:
        warm_up(mock, gateway)
        bench(gateway.url, 64, 128 if stream else 500, stream=stream, tokens=tokens)
        pid = gateway.popen.pid
        loop_before, others_before = thread_cpu_s(pid)
        started_s = time.monotonic()
        bench(gateway.url, 64, requests, stream=stream, tokens=tokens)
        elapsed_s = time.monotonic() - started_s
        loop_after, others_after = thread_cpu_s(pid)
    units = requests * tokens if stream else requests
    loop_us = (loop_after - loop_before) / units * 1e6
    others_us = (others_after - others_before) / units * 1e6
    return {"cpu_us": loop_us + others_us, "loop_us": loop_us, "others_us": others_us,
            "rps": units / elapsed_s}  # fmt: skip


def thread_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds of the process's main thread (the event loop's), and of all its others."""
    loop = others = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            ticks = cpu_ticks(task / "stat")
            if task.name == str(pid):
                loop += ticks
            else:
                others += ticks
    return loop / TICKS_PER_S, others / TICKS_PER_S


def markdown(report: dict[str, Any]) -> str:
    runs: dict[str, list[dict[str, float]]] = report["runs"]
    load = ", ".join(f"{x:.2f}" for x in report["load"])
    stream = report.get("stream", False)
    load_text = (
        f"{report['requests']:,} streams of {STREAM_TOKENS} tokens at {report['tps']:g} tokens/s "
        "a run, 64 in flight"
        if stream
        else f"{report['requests']:,} non-stream requests of 16 tokens a run, 64 in flight"
    )
    lines = [
        f"Run {report['when']} on {report['machine']}; load average before {load}; "
        f"{load_text}, a fresh gateway each; medians of {report['rounds']} rounds; all on = "
        f"overhead.py's `--features all` ({all_on_choice(report)}).",
        "",
    ]
    digits = 2 if stream else 0
    rows = []
    for name, measured in runs.items():
        saved = None
        if "all" in runs and name != "all":
            pairs = zip(runs["all"], measured, strict=False)
            saved = statistics.median(a["cpu_us"] - b["cpu_us"] for a, b in pairs)
        rows.append([
            f"`{name}` ({SETUPS[name]})",
            *(cell(statistics.median(r[key] for r in measured), digits)
              for key in ("cpu_us", "loop_us", "others_us")),
            cell(statistics.median(r["rps"] for r in measured), 0),
            cell(saved, digits),
        ])  # fmt: skip
    unit, rate = ("CPU µs a token", "tokens/s") if stream else ("CPU µs a request", "req/s")
    columns = (
        ("set-up", None, 0), (unit, None, 0), ("loop thread", None, 0),
        ("other threads", None, 0), (rate, None, 0), ("saved against all", None, 0),
    )  # fmt: skip
    lines += table(columns, rows)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
