"""Redis commands per request through the gateway with every feature on, counted by Redis itself.

    python benchmarks/storage_calls.py [--levels 1,64] [--requests 2000]

Starts a private redis-server, the unpaced simulated backend and `tokenweir serve` on the
policy of `overhead.py --features all` (Qwen tokenizer, the whole budget card, rpm/tpm/
max_concurrent, the exact cache, a SQLite ledger; all on that Redis). For each level it resets
Redis's INFO commandstats, sends `--requests` non-stream requests `level` at a time with
`tokenweir bench`, and divides each command's count by the requests answered. Script calls
(EVALSHA and EVAL) are the storage round trips; Redis's own CPU time per request is shown
(INFO cpu, whatever it spent it on), and every command by name (those the scripts run too).
Results: benchmarks/results/storage-calls.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
from harness import bench, publish, started, warm_up
from overhead import gateway_config

from tests.redis_server import private_redis

_IGNORED = {"config|resetstat", "info", "config", "ping"}
_SUMMARY = ("requests", "script_calls", "redis_cpu_us")


def commands(admin: redis.Redis) -> dict[str, int]:
    """Calls per command since the last reset."""
    stats = admin.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): int(row["calls"])
        for name, row in stats.items()
        if name.removeprefix("cmdstat_") not in _IGNORED
    }


def redis_cpu_s(admin: redis.Redis) -> float:
    """The Redis process's CPU time (its own clock, unlike commandstats' wall-clock `usec`,
    which grows whenever a busy machine takes the core from Redis mid-script)."""
    cpu = admin.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def level_calls(admin: redis.Redis, url: str, concurrency: int, requests: int) -> dict[str, float]:
    admin.config_resetstat()
    cpu_before = redis_cpu_s(admin)
    done = bench(url, concurrency, requests, stream=False, tokens=16)
    answered = max(1, int(done["ok"]))
    redis_cpu_us = (redis_cpu_s(admin) - cpu_before) / answered * 1e6
    per_request = {name: calls / answered for name, calls in sorted(commands(admin).items())}
    scripts = per_request.get("evalsha", 0.0) + per_request.get("eval", 0.0)
    return {
        "requests": answered,
        "script_calls": scripts,
        "redis_cpu_us": redis_cpu_us,
        **per_request,
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"Run {report['when']} on {report['machine']}; {report['requests']:,} non-stream "
        "requests per level, every feature on (overhead.py --features all's policy).",
        "",
        "| in flight | script calls / request | Redis CPU µs / request "
        "| every command / request (the scripts' own included) |",
        "|---:|---:|---:|---|",
    ]
    for level, row in report["levels"].items():
        others = ", ".join(
            f"{name} {value:.2f}"
            for name, value in row.items()
            if name not in _SUMMARY and value >= 0.005
        )
        lines.append(
            f"| {level} | {row['script_calls']:.2f} | {row['redis_cpu_us']:.1f} | {others} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,64")
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    report: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}",
        "requests": args.requests, "levels": {},
    }  # fmt: skip
    with private_redis() as redis_url, tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        unpaced = ["mock-backend", "--tokens-per-second", "inf"]
        with started(unpaced, "/v1/models", work / "mock.log") as mock:
            serve = ["serve", "--config", str(gateway_config(mock.url, work, redis_url))]
            with (
                started(serve, "/healthz", work / "gateway.log") as gateway,
                redis.Redis.from_url(redis_url) as admin,
            ):
                warm_up(mock, gateway)
                for level in (int(x) for x in args.levels.split(",")):
                    print(f"{level} in flight ...", file=sys.stderr, flush=True)
                    report["levels"][level] = level_calls(admin, gateway.url, level, args.requests)
    publish("storage-calls", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
