"""Gateway CPU per non-stream request, every feature on, for two source trees in one run.

    python benchmarks/tree_ab.py --base DIR [--rounds 6] [--requests 3000] [--levels 64,1]
        [--features all|off]

DIR is another checkout (say `git worktree add DIR main`, or `git archive main | tar -x -C
DIR`, with `shared/` beside it as here). Starts one redis-server per tree, the unpaced
simulated backend, and a `tokenweir serve` from each tree on overhead.py's `--features all`
policy with tracing and OTLP metrics exported (or, with `--features off`, the bare gateway:
auth only, no telemetry; its redis-server is started but unused, so its script calls read 0),
both running throughout. Each round sends the
same load through one, then the other (the order alternating by round), and reads each
gateway's CPU time from /proc and its Redis's INFO commandstats around its own run. Reports
medians over the rounds: CPU µs per request, requests/s, and Redis script calls per request.
The machine's other work hits both trees alike: what differs is the code.
Results: benchmarks/results/tree-ab.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis
from harness import (
    Process,
    Samples,
    bench,
    cell,
    free_port,
    publish,
    running,
    started,
    table,
    warm_up,
)
from otelsink import otlp_sink
from overhead import TELEMETRY_ENV, gateway_config

from tests.redis_server import private_redis

HERE = Path(__file__).resolve().parents[1]


@contextmanager
def gateway_of(tree: Path, config: Path, log: Path) -> Iterator[Process]:
    """`tokenweir serve` run from `tree` (`python -m proxy` imports the package from its cwd)."""
    port = free_port()
    command = [sys.executable, "-m", "proxy", "serve", "--config", str(config), "--port", str(port)]
    with running(command, port, "/healthz", log, f"the gateway of {tree}", cwd=tree) as process:
        yield process


def script_calls(admin: redis.Redis) -> int:
    stats = admin.info("commandstats")
    return sum(
        int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("evalsha", "eval")
    )


def one_run(
    gateway: Process, admin: redis.Redis, concurrency: int, requests: int
) -> dict[str, float]:
    calls_before, cpu_before = script_calls(admin), gateway.cpu_s()
    done = bench(gateway.url, concurrency, requests, stream=False, tokens=16)
    answered = max(1, int(done["ok"]))
    return {
        "cpu_us_per_request": (gateway.cpu_s() - cpu_before) / answered * 1e6,
        "requests_per_s": float(done["requests_per_s"]),
        "script_calls_per_request": (script_calls(admin) - calls_before) / answered,
        "errors": float(sum(done["errors"].values())),
    }


def compare(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    trees = {"base": base, "this": HERE}
    levels: dict[str, Any] = {}
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        endpoint, _ = stack.enter_context(otlp_sink())
        if args.features == "all":
            os.environ.update(TELEMETRY_ENV)
            os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
        unpaced = ["mock-backend", "--tokens-per-second", "inf"]
        mock = stack.enter_context(started(unpaced, "/v1/models", work / "mock.log"))
        gateways: dict[str, tuple[Process, redis.Redis]] = {}
        for name, tree in trees.items():
            redis_url = stack.enter_context(private_redis())
            (work / name).mkdir()
            storage = redis_url if args.features == "all" else None
            config = gateway_config(mock.url, work / name, storage)
            gateway = stack.enter_context(gateway_of(tree, config, work / f"{name}.log"))
            gateways[name] = (gateway, stack.enter_context(redis.Redis.from_url(redis_url)))
            warm_up(gateway)
        for level in (int(x) for x in args.levels.split(",")):
            samples = {name: Samples() for name in trees}
            for round_ in range(args.rounds):
                order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
                for name in order:
                    print(f"{level} in flight, round {round_ + 1}: {name}", file=sys.stderr)
                    for key, value in one_run(*gateways[name], level, args.requests).items():
                        samples[name].add(key, value)
            levels[str(level)] = {
                name: {key: found.median(key) for key in found.values}
                for name, found in samples.items()
            }
    return levels


COLUMNS = (
    ("in flight", None, 0),
    ("tree", None, 0),
    ("gateway CPU µs/request", "cpu_us_per_request", 0),
    ("req/s", "requests_per_s", 0),
    ("Redis script calls/request", "script_calls_per_request", 2),
)


def markdown(report: dict[str, Any]) -> str:
    rows = [
        [level, name, *(cell(row.get(key), digits) for _, key, digits in COLUMNS if key)]
        for level, trees in report["levels"].items()
        for name, row in trees.items()
    ]
    intro = (
        f"Run {report['when']} on {report['machine']}; load average {report['load']}; "
        f"{report['requests']:,} non-stream requests per run, medians of {report['rounds']} "
        "rounds alternating the trees; "
        + (
            "every feature on (overhead.py --features all, tracing and OTLP metrics exported)"
            if report["features"] == "all"
            else "the bare gateway (overhead.py's plain policy: auth only)"
        )
        + ". `base` is the tree given, `this` this checkout."
    )
    return "\n".join([intro, "", *table(COLUMNS, rows)]) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--levels", default="64,1")
    parser.add_argument("--features", choices=("all", "off"), default="all")
    args = parser.parse_args()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    report: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}",
        "load": load, "requests": args.requests, "rounds": args.rounds,
        "features": args.features,
        "base": str(args.base.resolve()),
        "levels": compare(args, args.base.resolve()),
    }  # fmt: skip
    publish("tree-ab" if args.features == "all" else "tree-ab-off", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
