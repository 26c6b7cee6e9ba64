"""Gateway CPU per non-stream request (or per streamed token), for two source trees in one run.

    python benchmarks/tree_ab.py --base DIR [--rounds 6] [--requests 3000] [--levels 64,1]
        [--features all|off] [--stream [--tps 750] [--tokens 256]] [--system-words N]
        [--idle SECONDS] [--ledger sqlite|redis] [--tokenizer qwen|o200k]

DIR is another checkout (say `git worktree add DIR main`, or `git archive main | tar -x -C
DIR`, with `shared/` beside it as here). Starts one redis-server per tree, the unpaced
simulated backend, and a `tokenweir serve` from each tree on overhead.py's `--features all`
policy with tracing and OTLP metrics exported (or, with `--features off`, the bare gateway:
auth only, no telemetry; its redis-server is started but unused, so its script calls read 0),
both running throughout. Each round sends the
same load through one, then the other (the order alternating by round), and reads each
gateway's CPU time from /proc and its Redis's INFO commandstats around its own run. Reports
medians over the rounds: CPU µs per request, requests/s, Redis script calls and Redis's CPU
(INFO cpu, user and system) per request, and how often the event loop's thread blocked a
request (its voluntary context switches: a loop with nothing to do, or the GIL held by the
ledger's writer or the span exporter).
With `--stream` the load is streams of `--tokens` tokens from a backend paced at `--tps` tokens
a second (each token its own read, as from a real engine), `--requests` is per stream in flight
(at least 16 a run), and the report is CPU µs per streamed token and the gateway's TTFT p50.
With `--system-words N` every request is a chat as an application sends it: the same system
prompt of N words, then a question of its own (different in every run, so the response cache
never answers it); without, bench's synthetic prompts of 64 tokens.
With `--idle S` nothing is sent: each round reads each gateway's CPU over S seconds of no load
(its timers and background threads; a real gateway is idle between requests too).
With `--unix-redis this` this tree's gateway reaches its redis-server over a Unix socket
(unix://) and the base's over TCP (`--base` naming this checkout compares the two transports);
with `--unix-redis both`, both trees' do.
`--ledger redis --tokenizer o200k` run issue 16's own "all on", as in overhead.py (each tree's
ledger on its own redis-server).
The machine's other work hits both trees alike: what differs is the code.
Results: benchmarks/results/tree-ab{,-off}{,-stream}{,-chats}{,-idle}{,-redis-ledger}{,-o200k}
.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import secrets
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
from overhead import TELEMETRY_ENV, all_on_choice, gateway_config
from storage_calls import redis_cpu_s

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


def threads_cpu_s(gateway: Process) -> float:
    """The CPU time of the gateway's threads, to the nanosecond (/proc's process total counts
    10 ms ticks: too coarse for an idle process)."""
    total_ns = 0
    for task in Path(f"/proc/{gateway.popen.pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            total_ns += int((task / "schedstat").read_text().split()[0])
    return total_ns / 1e9


def loop_sleeps(gateway: Process) -> int:
    """How often the gateway's main thread (its event loop's) has blocked: an idle loop's
    wait, or the GIL held by another thread (the ledger's writer, the span exporter)."""
    status = Path(f"/proc/{gateway.popen.pid}/task/{gateway.popen.pid}/status").read_text()
    return next(
        int(line.split()[1])
        for line in status.splitlines()
        if line.startswith("voluntary_ctxt_switches")
    )


def one_run(
    gateway: Process, admin: redis.Redis, concurrency: int, args: argparse.Namespace
) -> dict[str, float]:
    if args.idle:
        cpu_before, began = threads_cpu_s(gateway), time.monotonic()
        time.sleep(args.idle)
        spent_s = threads_cpu_s(gateway) - cpu_before
        return {"idle_cpu_ms_per_s": spent_s / (time.monotonic() - began) * 1e3}
    prompts = chats(args.system_words, args.requests) if args.system_words else None
    calls_before, cpu_before = script_calls(admin), gateway.cpu_s()
    redis_before = redis_cpu_s(admin)
    sleeps_before = loop_sleeps(gateway)
    if args.stream:
        requests = max(16, concurrency * args.requests)
        done = bench(
            gateway.url, concurrency, requests, stream=True, tokens=args.tokens,
            prompt_file=prompts,
        )  # fmt: skip
    else:
        done = bench(
            gateway.url, concurrency, args.requests, stream=False, tokens=16, prompt_file=prompts
        )
    cpu_s = gateway.cpu_s() - cpu_before
    if prompts is not None:
        prompts.unlink()
    answered = max(1, int(done["ok"]))
    found = {
        "requests_per_s": float(done["requests_per_s"]),
        "script_calls_per_request": (script_calls(admin) - calls_before) / answered,
        "redis_cpu_us_per_request": (redis_cpu_s(admin) - redis_before) / answered * 1e6,
        "loop_sleeps_per_request": (loop_sleeps(gateway) - sleeps_before) / answered,
        "errors": float(sum(done["errors"].values())),
    }
    if args.stream:
        found["cpu_us_per_token"] = cpu_s / max(1, int(done["output_tokens"])) * 1e6
        found["ttft_ms"] = float(done["ttft_s"]["p50"]) * 1000
    else:
        found["cpu_us_per_request"] = cpu_s / answered * 1e6
    return found


_WORDS = "the of and to in a is that for it as was with be by on not this are or from at".split()


def chats(system_words: int, count: int) -> Path:
    """A JSONL prompt file for bench: `count` chats, one system prompt, a new question each."""
    rng = random.Random(0)
    system = " ".join(rng.choice(_WORDS) for _ in range(system_words)) + "."
    run = secrets.token_hex(8)
    lines = [
        json.dumps({"messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Question {run}-{n}: what follows from that?"},
        ]})
        for n in range(count)
    ]  # fmt: skip
    path = Path(tempfile.gettempdir()) / f"tree-ab-chats-{run}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def compare(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    trees = {"base": base, "this": HERE}
    levels: dict[str, Any] = {}
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        endpoint, _ = stack.enter_context(otlp_sink())
        if args.features == "all":
            os.environ.update(TELEMETRY_ENV)
            os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
        pace = str(args.tps) if args.stream else "inf"
        backend = ["mock-backend", "--tokens-per-second", pace]
        mock = stack.enter_context(started(backend, "/v1/models", work / "mock.log"))
        gateways: dict[str, tuple[Process, redis.Redis]] = {}
        for name, tree in trees.items():
            over_unix = args.unix_redis == "both" or (args.unix_redis == "this" and name == "this")
            unix = work / f"redis-{name}.sock" if over_unix else None
            redis_url = stack.enter_context(private_redis(unix))
            (work / name).mkdir()
            storage = redis_url if args.features == "all" else None
            parts = {"ledger": args.ledger, "tokenizer": args.tokenizer}
            config = gateway_config(mock.url, work / name, storage, **parts)
            gateway = stack.enter_context(gateway_of(tree, config, work / f"{name}.log"))
            gateways[name] = (gateway, stack.enter_context(redis.Redis.from_url(redis_url)))
            warm_up(gateway)
        for level in [0] if args.idle else (int(x) for x in args.levels.split(",")):
            samples = {name: Samples() for name in trees}
            for round_ in range(args.rounds):
                order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
                for name in order:
                    print(f"{level} in flight, round {round_ + 1}: {name}", file=sys.stderr)
                    for key, value in one_run(*gateways[name], level, args).items():
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
    ("Redis CPU µs/request", "redis_cpu_us_per_request", 0),
    ("loop thread sleeps/request", "loop_sleeps_per_request", 2),
)
STREAM_COLUMNS = (
    ("streams", None, 0),
    ("tree", None, 0),
    ("gateway CPU µs/token", "cpu_us_per_token", 1),
    ("TTFT p50 ms", "ttft_ms", 2),
    ("Redis script calls/stream", "script_calls_per_request", 2),
    ("Redis CPU µs/stream", "redis_cpu_us_per_request", 0),
    ("loop thread sleeps/stream", "loop_sleeps_per_request", 2),
)


IDLE_COLUMNS = (
    ("in flight", None, 0),
    ("tree", None, 0),
    ("gateway CPU ms/s, idle", "idle_cpu_ms_per_s", 2),
)


def markdown(report: dict[str, Any]) -> str:
    if report.get("idle"):
        columns = IDLE_COLUMNS
    else:
        columns = STREAM_COLUMNS if report.get("stream") else COLUMNS
    rows = [
        [level, name, *(cell(row.get(key), digits) for _, key, digits in columns if key)]
        for level, trees in report["levels"].items()
        for name, row in trees.items()
    ]
    load = (
        f"streams of {report['tokens']} tokens at {report['tps']:g} tokens/s, "
        f"{report['requests']} streams a run for each one in flight (at least 16)"
        if report.get("stream")
        else f"{report['requests']:,} non-stream requests per run"
    )
    if report.get("idle"):
        load = f"no load: each gateway's CPU over {report['idle']:g} s with nothing sent"
    if report.get("system_words"):
        load += f", each a chat with the same {report['system_words']:,}-word system prompt"
    intro = (
        f"Run {report['when']} on {report['machine']}; load average {report['load']}; "
        f"{load}, medians of {report['rounds']} rounds alternating the trees; "
        + (
            "every feature on (overhead.py --features all, tracing and OTLP metrics exported; "
            f"{all_on_choice(report)})"
            if report["features"] == "all"
            else "the bare gateway (overhead.py's plain policy: auth only)"
        )
        + ". `base` is the tree given, `this` this checkout."
    )
    return "\n".join([intro, "", *table(columns, rows)]) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--levels", default="64,1")
    parser.add_argument("--features", choices=("all", "off"), default="all")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--tps", type=float, default=750.0)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--system-words", type=int, default=0, help="chats with a system prompt")
    parser.add_argument("--idle", type=float, default=0.0, help="seconds of no load a round")
    parser.add_argument("--ledger", choices=["sqlite", "redis"], default="sqlite")
    parser.add_argument("--tokenizer", choices=["qwen", "o200k"], default="qwen")
    parser.add_argument(
        "--unix-redis",
        choices=("this", "both"),
        help="which trees' gateways reach their Redis over a Unix socket (else TCP)",
    )
    args = parser.parse_args()
    if (args.ledger, args.tokenizer) != ("sqlite", "qwen") and args.features != "all":
        parser.error("--ledger and --tokenizer choose parts of --features all")
    if args.requests is None:
        args.requests = 8 if args.stream else 3000
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    report: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}",
        "load": load, "requests": args.requests, "rounds": args.rounds,
        "features": args.features, "stream": args.stream, "tps": args.tps, "tokens": args.tokens,
        "system_words": args.system_words, "idle": args.idle,
        "ledger": args.ledger, "tokenizer": args.tokenizer,
        "base": str(args.base.resolve()),
        "levels": compare(args, args.base.resolve()),
    }  # fmt: skip
    name = ("tree-ab" if args.features == "all" else "tree-ab-off") + ("-stream" * args.stream)
    name += "-chats" * bool(args.system_words) + "-idle" * bool(args.idle)
    name += "-redis-ledger" * (args.ledger == "redis") + "-o200k" * (args.tokenizer == "o200k")
    publish(name, report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
