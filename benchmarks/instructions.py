"""Instructions per request, counted by callgrind: what each feature costs, the same every run.

    python benchmarks/instructions.py [--requests 300] [--concurrency 1] [--stream] [--tokens 16]
                                      [--tps inf] [--steps bare,redis,...] [--base DIR]

CPU time on this shared machine moves by a quarter from one hour to the next, and effects of
20-50 µs a request drown in it. Callgrind counts the instructions a process executes instead:
the same code on the same input gives the same count whatever else the machine is doing.

Starts `tokenweir mock-backend` (unpaced, or `--tps` tokens a second: a paced stream arrives a
token a read, as from a real engine, where an unpaced one comes in a few reads) and a private
redis-server as they are, and
`tokenweir serve` under `valgrind --tool=callgrind` with counting off. After a warm-up it turns
counting on (`callgrind_control -i on`), sends `--requests` requests of `--tokens` tokens with
`tokenweir bench` (non-stream unless `--stream`), and dumps the counts, one file per thread.
Each step adds one feature to the step before, ending at overhead.py's `--features all`:

    bare       auth only, memory storage
    redis      Redis storage
    tokenizer  a real tokenizer (Qwen2.5, from ../shared)
    budget     the whole budget card, daily token and USD quotas
    limits     requests and tokens per minute, max_concurrent
    cache      the exact response cache, every answer stored
    ledger     the SQLite ledger
    tracing    traces exported (the direct path) to a stand-in collector over OTLP/HTTP
    metrics    OTLP metrics exported too, every 5 s (overhead.py's telemetry)
    sdk        the same with the SDK's tracing path (TOKENWEIR_TRACE_PATH=sdk) instead

Reports, per step, instructions a request on the event loop's thread and on the others (the
ledger's writer, the span and metric exporters), and what the step added to the one before.
With `--base DIR` (another checkout, as for tree_ab.py) every step runs from both trees.

What the count leaves out, and what it weighs differently from service:
- the kernel: system calls (socket reads and writes, epoll) are not counted;
- the clock: under valgrind the gateway runs about 50 times slower, so work done on a timer
  (the ledger's flush, span batches, the 5 s metric export) carries fewer requests a batch than
  in service and weighs more a request. Most of it lands in the other threads' column.
An instruction is not a fixed time either (cache misses, branches); the count ranks changes to
the same code, and CPU time (overhead.py, tree_ab.py) says what they are worth.
Results: benchmarks/results/instructions.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from budgets import QWEN
from harness import (
    bench,
    cell,
    free_port,
    otel_environment,
    policy_for,
    publish,
    running,
    started,
    table,
)
from otelsink import otlp_sink
from overhead import ALL_BUDGET, ALL_LIMITS, TELEMETRY_ENV

from tests.redis_server import private_redis

HERE = Path(__file__).resolve().parents[1]

STEPS: tuple[tuple[str, str], ...] = (
    ("bare", "auth only"),
    ("redis", "+ Redis storage"),
    ("tokenizer", "+ tokenizer"),
    ("budget", "+ budget card"),
    ("limits", "+ limits"),
    ("cache", "+ exact cache"),
    ("ledger", "+ SQLite ledger"),
    ("tracing", "+ tracing"),
    ("metrics", "+ OTLP metrics"),
    ("sdk", "tracing through the SDK instead"),
)


def policy_of(step: str, backend: str, redis_url: str, work: Path) -> Path:
    """The policy of `step`: every feature of the steps before it, and its own."""
    names = [name for name, _ in STEPS]
    upto = set(names[: names.index(step) + 1])
    features: dict[str, str] = {}
    if "redis" in upto:
        features["storage"] = redis_url
    if "tokenizer" in upto:
        features["tokenizer"] = str(QWEN)
    if "budget" in upto:
        features["budget"] = ALL_BUDGET
    if "limits" in upto:
        features["limits"] = ALL_LIMITS
    if "cache" in upto:
        features["cache"] = "{mode: exact}"
    if "ledger" in upto:
        features["ledger"] = f"sqlite:///{work / 'ledger.db'}"
    return policy_for(backend, work, name=step, **features)


def environ_of(step: str, endpoint: str) -> dict[str, str]:
    if step == "tracing":
        return {**environ_of("metrics", endpoint), "OTEL_METRICS_EXPORTER": "none"}
    if step == "metrics":
        return {**TELEMETRY_ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}
    if step == "sdk":
        return {**environ_of("metrics", endpoint), "TOKENWEIR_TRACE_PATH": "sdk"}
    return {}


def counted(tree: Path, policy: Path, work: Path, args: argparse.Namespace) -> dict[str, float]:
    """Instructions a request of `tree`'s gateway on `policy`: the loop's thread, the others."""
    port, out = free_port(), work / "callgrind.out"
    command = [
        "valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
        f"--callgrind-out-file={out}",
        sys.executable, "-m", "proxy", "serve", "--config", str(policy), "--port", str(port),
    ]  # fmt: skip
    # Under valgrind a gateway starts (and writes its counts at the end) many times slower: on a
    # busy machine 30 s was not always enough.
    log, name = work / "gateway.log", f"{tree}'s gateway"
    with running(command, port, "/healthz", log, name, tree, within_s=300) as gw:
        bench(gw.url, args.concurrency, 100, stream=args.stream, tokens=args.tokens)  # warm-up
        control(gw.popen.pid, "-i", "on")
        done = bench(
            gw.url, args.concurrency, args.requests, stream=args.stream, tokens=args.tokens
        )
        control(gw.popen.pid, "-d")
        control(gw.popen.pid, "-i", "off")
        dumps = wait_for_dumps(out)
    if done["ok"] != args.requests:
        raise RuntimeError(f"{args.requests - done['ok']} requests failed: {done['errors']}")
    loop = sum(total for thread, total in dumps if thread == 1)
    others = sum(total for thread, total in dumps if thread != 1)
    return {"loop": loop / args.requests, "others": others / args.requests}


def control(pid: int, *options: str) -> None:
    subprocess.run(["callgrind_control", *options, str(pid)], check=True, capture_output=True)


def wait_for_dumps(out: Path) -> list[tuple[int, int]]:
    """(thread, instructions) of each file of the first dump (`out.1-01`, `out.1-02`, ...),
    once every file is whole (ends with its totals) and no new one has come for half a second."""
    deadline = time.monotonic() + 60
    seen: list[tuple[int, int]] | None = None
    while time.monotonic() < deadline:
        found = [read_dump(path) for path in sorted(out.parent.glob(f"{out.name}.1-*"))]
        whole = [counts for counts in found if counts is not None]
        if whole and len(whole) == len(found) and whole == seen:
            return whole
        seen = whole if len(whole) == len(found) else None
        time.sleep(0.5)
    raise RuntimeError(f"callgrind wrote no whole dump beside {out}")


def read_dump(path: Path) -> tuple[int, int] | None:
    """(thread, instructions) of one thread's dump file; None until it is written out."""
    thread = total = None
    for line in path.read_text().splitlines():
        if line.startswith("thread:"):
            thread = int(line.split()[1])
        elif line.startswith(("summary:", "totals:")):
            total = int(line.split()[1])
    return None if thread is None or total is None else (thread, total)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    trees = {"this": HERE} if args.base is None else {"base": args.base.resolve(), "this": HERE}
    steps: dict[str, Any] = {}
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        endpoint, _ = stack.enter_context(otlp_sink())
        backend = ["mock-backend", "--tokens-per-second", args.tps]
        mock = stack.enter_context(started(backend, "/v1/models", Path(tmp) / "mock.log"))
        redis_url = stack.enter_context(private_redis())
        for step in args.steps.split(","):
            steps[step] = {}
            for name, tree in trees.items():
                print(f"{step}: {name}", file=sys.stderr, flush=True)
                work = Path(tmp) / f"{step}-{name}"
                work.mkdir()
                policy = policy_of(step, mock.url, redis_url, work)
                with otel_environment(environ_of(step, endpoint)):
                    steps[step][name] = counted(tree, policy, work, args)
    return steps


def markdown(report: dict[str, Any]) -> str:
    labels = dict(STEPS)
    columns = (
        ("step", None, 0), ("tree", None, 0), ("loop thread", "loop", 0),
        ("other threads", "others", 0), ("all threads", "all", 0), ("added", "added", 0),
    )  # fmt: skip
    rows: list[list[str]] = []
    before: dict[str, float] = {}
    for step, trees in report["steps"].items():
        for tree, found in trees.items():
            whole = found["loop"] + found["others"]
            added = whole - before[tree] if tree in before else None
            if step != "sdk":  # the SDK step replaces tracing; it does not add to it
                before[tree] = whole
            values = {**found, "all": whole, "added": added}
            rows.append([labels[step], tree, *(cell(values[k], d) for _, k, d in columns[2:])])
    intro = (
        f"Run {report['when']} on {report['machine']}; {report['requests']} "
        f"{'streamed' if report['stream'] else 'non-stream'} requests of "
        f"{report['tokens']} tokens ({report['tps']} tokens/s), "
        f"{report['concurrency']} at a time; instructions a request (callgrind). Each step adds "
        "its feature to the steps above it; `added` is the difference from the step above "
        "(for the SDK step, from the metrics step: the direct path)."
    )
    return "\n".join([intro, "", *table(columns, rows)]) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--tps", default="inf", help="the backend's tokens a second a stream")
    parser.add_argument("--steps", default=",".join(name for name, _ in STEPS))
    parser.add_argument("--base", type=Path)
    args = parser.parse_args()
    if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        parser.error("needs valgrind and callgrind_control (Debian: apt-get install valgrind)")
    unknown = set(args.steps.split(",")) - {name for name, _ in STEPS}
    if unknown:
        parser.error(f"unknown steps: {', '.join(sorted(unknown))}")
    report: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}",
        "requests": args.requests, "concurrency": args.concurrency, "stream": args.stream,
        "tokens": args.tokens, "tps": args.tps,
        "base": str(args.base.resolve()) if args.base else None,
        "steps": measure(args),
    }  # fmt: skip
    publish("instructions", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
