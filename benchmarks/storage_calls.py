"""Redis commands per request through the gateway with every feature on, counted by Redis itself.

    python benchmarks/storage_calls.py [--levels 1,64] [--requests 2000]

Starts a private redis-server, the unpaced simulated backend and `tokenweir serve` on the
policy of `overhead.py --features all` (Qwen tokenizer, the whole budget card, rpm/tpm/
max_concurrent, the exact cache, a SQLite ledger; all on that Redis). For each level it resets
Redis's INFO commandstats, sends `--requests` non-stream requests `level` at a time with
`tokenweir bench`, and divides each command's count by the requests answered. Script calls
(EVALSHA and EVAL) are the storage round trips; the rest is shown by command.
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


def commands(admin: redis.Redis) -> dict[str, int]:
    stats = admin.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): int(row["calls"])
        for name, row in stats.items()
        if name.removeprefix("cmdstat_") not in _IGNORED
    }


def level_calls(admin: redis.Redis, url: str, concurrency: int, requests: int) -> dict[str, float]:
    admin.config_resetstat()
    done = bench(url, concurrency, requests, stream=False, tokens=16)
    answered = max(1, int(done["ok"]))
    counted = commands(admin)
    per_request = {name: calls / answered for name, calls in sorted(counted.items())}
    scripts = per_request.get("evalsha", 0.0) + per_request.get("eval", 0.0)
    return {"requests": answered, "script_calls": scripts, **per_request}


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"Run {report['when']} on {report['machine']}; {report['requests']:,} non-stream "
        "requests per level, every feature on (overhead.py --features all's policy).",
        "",
        "| in flight | script calls / request | every command / request |",
        "|---:|---:|---|",
    ]
    for level, row in report["levels"].items():
        others = ", ".join(
            f"{name} {value:.2f}"
            for name, value in row.items()
            if name not in ("requests", "script_calls") and value >= 0.005
        )
        lines.append(f"| {level} | {row['script_calls']:.2f} | {others} |")
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
