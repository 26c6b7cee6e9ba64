"""`tokenweir serve --workers 2` against one worker, all on, with a load that leaves it the cores.

    python benchmarks/workers_scale.py [--rounds 3] [--seconds 15] [--levels stream:64,...]
                                       [--ledger sqlite|redis] [--tokenizer qwen|o200k]

On two cores, overhead.py's load generator (`tokenweir bench`, Python) and simulated backend
(`tokenweir mock-backend`, Python) take about half a core each from the gateway they measure,
so a second worker has little to gain. This benchmark measures what the gateway itself does
with a second core: the load comes from wrk and the backend's answers from nginx (both C, a
few µs a request; Debian packages `wrk` and `nginx-light`), while the gateway runs with every
feature on, as `overhead.py --features all`: Redis storage (a private redis-server), the Qwen
tokenizer, the whole budget card with daily token and USD quotas, requests and tokens per
minute and max_concurrent, the exact cache with every answer stored (every prompt differs),
the SQLite ledger, traces and OTLP metrics exported to a stand-in collector. `--ledger redis`
and `--tokenizer o200k` change those two parts, as in overhead.py (issue 16's own "all on").

nginx answers with `tokenweir mock-backend`'s own bytes, fetched once at the start: a JSON
answer of 16 tokens and a stream of 256 (unpaced: the whole stream as fast as the gateway
reads it). Two gateways run side by side (one worker, two workers) on the same Redis; each
round measures every level on both, the order alternating, `--seconds` of wrk after 3 s of
warm-up. Levels: `plain:N` (non-stream, N connections) and `stream:N` (N streams at a time).
Reports requests/s (and tokens/s) for each, the ratio of two workers to one (median of the
rounds' ratios), gateway CPU per request, and the CPU the rest took (wrk, nginx, Redis and
this process's collector) in cores; then the busiest and the idlest worker's cores (how evenly
the workers share the connections) and the machine's idle cores (what no process used).
Results: benchmarks/results/workers-scale[-redis-ledger][-o200k].{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import httpx
import redis
from harness import (
    KEY,
    Process,
    cell,
    free_port,
    machine_idle_s,
    otel_environment,
    publish,
    running,
    table,
)
from otelsink import otlp_sink
from overhead import ALL_BUDGET, ALL_LIMITS, TELEMETRY_ENV, all_on_choice, all_on_parts

from proxy.policy.units import hash_key
from tests.redis_server import private_redis

HERE = Path(__file__).parent
WARM_UP_S = 3
TOKENS = {"plain": 16, "stream": 256}  # completion tokens of nginx's two answers
MODELS = {"plain": "mock-llm", "stream": "mock-stream"}


def answers(work: Path) -> None:
    """`tokenweir mock-backend`'s answer of 16 tokens and stream of 256, as files for nginx."""
    port = free_port()
    command = [sys.executable, "-m", "proxy", "mock-backend", "--port", str(port),
               "--tokens-per-second", "inf"]  # fmt: skip
    with running(command, port, "/v1/models", work / "mock.log", "mock-backend"):
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        asked = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]}
        plain = {**asked, "max_tokens": 16, "mock_completion_tokens": 16}
        stream = {**asked, "max_tokens": 256, "mock_completion_tokens": 256, "stream": True,
                  "stream_options": {"include_usage": True}}  # fmt: skip
        (work / "plain.json").write_bytes(httpx.post(url, json=plain).raise_for_status().content)
        (work / "stream.sse").write_bytes(httpx.post(url, json=stream).raise_for_status().content)


NGINX = """
worker_processes 1;
daemon off;
pid {work}/nginx.pid;
error_log {work}/nginx-error.log;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  keepalive_requests 100000000;
  keepalive_timeout 600s;
  server {{
    listen 127.0.0.1:{plain};
    location / {{ default_type application/json; root {work}; rewrite ^ /plain.json break;
                 error_page 405 =200 $uri; }}
  }}
  server {{
    listen 127.0.0.1:{stream};
    location / {{ default_type text/event-stream; root {work}; rewrite ^ /stream.sse break;
                 error_page 405 =200 $uri; }}
  }}
}}
"""


@contextlib.contextmanager
def nginx(work: Path) -> Iterator[tuple[Process, dict[str, int]]]:
    """nginx answering every POST with the mock's answer (one port) or stream (another); the
    static module turns away a POST with 405, which error_page makes the file's 200."""
    ports = {"plain": free_port(), "stream": free_port()}
    work.chmod(0o755)  # nginx's worker process (not root) reads the answers
    config = work / "nginx.conf"
    config.write_text(NGINX.format(work=work, **ports))
    command = ["nginx", "-c", str(config), "-p", str(work)]
    with running(command, ports["plain"], "/", work / "nginx.log", "nginx") as process:
        yield process, ports


def policy(work: Path, ports: dict[str, int], redis_url: str, args: argparse.Namespace) -> Path:
    """overhead.py's `--features all`, with a model on each of nginx's two answers."""
    path = work / "policy.yaml"
    ledger, tokenizer = all_on_parts(work, redis_url, args.ledger, args.tokenizer)
    path.write_text(f"""
storage: "{redis_url}"
ledger: "{ledger}"
backends:
  - {{name: answers, url: "http://127.0.0.1:{ports["plain"]}/v1", models: [mock-llm]}}
  - {{name: streams, url: "http://127.0.0.1:{ports["stream"]}/v1", models: [mock-stream]}}
models:
  mock-llm: {{price: {{input_per_1m: 0.1, output_per_1m: 0.4}}, tokenizer: "{tokenizer}"}}
  mock-stream: {{price: {{input_per_1m: 0.1, output_per_1m: 0.4}}, tokenizer: "{tokenizer}"}}
tenants:
  bench: {{api_keys: [{hash_key(KEY)}], models: [mock-llm, mock-stream], budget: {ALL_BUDGET},
          limits: {ALL_LIMITS}, cache: {{mode: exact}}}}
""")
    return path


def wrk(url: str, level: str, seconds: int) -> dict[str, Any]:
    """One wrk run at `level`; its summary line, and its own CPU seconds."""
    kind, connections = level.split(":")
    command = [
        "wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--timeout", "60s",
        "-s", str(HERE / "wrk_chat.lua"), url, "--", str(secrets.randbelow(1 << 30)),
        MODELS[kind], *(["stream"] if kind == "stream" else []),
    ]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    line = next((x for x in done.stdout.splitlines() if x.startswith("WRK ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no summary: {done.stdout}{done.stderr}")
    summary: dict[str, Any] = json.loads(line[4:])
    failed = sum(summary[k] for k in ("connect", "read", "write", "status", "timeout"))
    if failed:
        raise RuntimeError(f"{failed} of wrk's requests failed at {level}: {summary}\n"
                           f"{done.stderr[-2000:]}")  # fmt: skip
    summary["cpu_s"] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return summary


def cpu_of(redis_client: redis.Redis, nginx_: Process) -> dict[str, float]:
    """CPU seconds so far of what is not the gateway: Redis, nginx, and this process (the
    collector's thread)."""
    info = redis_client.info("cpu")
    return {
        "redis": float(info["used_cpu_user"]) + float(info["used_cpu_sys"]),
        "nginx": nginx_.cpu_s(),
        "collector": time.process_time(),
    }


def measure(
    gateway: Process, level: str, seconds: int, redis_client: redis.Redis, nginx_: Process
) -> dict[str, float]:
    wrk(gateway.url, level, WARM_UP_S)
    by_process, before = gateway.cpu_s_by_process(), cpu_of(redis_client, nginx_)
    idle = machine_idle_s()
    run = wrk(gateway.url, level, seconds)
    idle = machine_idle_s() - idle
    after, ended = cpu_of(redis_client, nginx_), gateway.cpu_s_by_process()
    requests, elapsed = run["requests"], run["seconds"]
    spent = {pid: ended[pid] - by_process.get(pid, 0.0) for pid in ended}
    cpu = sum(spent.values())
    workers = [spent[pid] for pid in worker_pids(spent)]
    return {
        **{f"{name}_cores": (after[name] - before[name]) / elapsed for name in before},
        "requests_per_s": requests / elapsed,
        "tokens_per_s": requests * TOKENS[level.split(":")[0]] / elapsed,
        "gateway_us_per_request": cpu / requests * 1e6,
        "gateway_cores": cpu / elapsed,
        "busiest_worker_cores": max(workers) / elapsed,
        "idlest_worker_cores": min(workers) / elapsed,
        "idle_cores": idle / elapsed,
        "wrk_cores": run["cpu_s"] / elapsed,
        "p50_ms": run["p50_ms"],
        "p99_ms": run["p99_ms"],
    }


def worker_pids(pids: Collection[int]) -> list[int]:
    """The processes that serve: with --workers N, those uvicorn's supervisor spawned (not the
    supervisor, nor multiprocessing's resource tracker); with one worker, the one process."""
    spawned = []
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                spawned.append(pid)
    return spawned or list(pids)[:1]


def run_suite(args: argparse.Namespace) -> dict[str, Any]:
    for tool in ("wrk", "nginx"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed: apt-get install wrk nginx-light")
    levels = args.levels.split(",")
    load_before = os.getloadavg()[0]
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        level: {"1": [], "2": []} for level in levels
    }
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        answers(work)
        nginx_, ports = stack.enter_context(nginx(work))
        redis_url = stack.enter_context(private_redis())
        redis_client = stack.enter_context(redis.Redis.from_url(redis_url))
        endpoint, _ = stack.enter_context(otlp_sink())
        stack.enter_context(
            otel_environment({**TELEMETRY_ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint})
        )
        config = policy(work, ports, redis_url, args)
        gateways: dict[str, Process] = {}
        for workers in ("1", "2"):
            port = free_port()
            command = [sys.executable, "-m", "proxy", "serve", "--config", str(config),
                       "--port", str(port), "--workers", workers]  # fmt: skip
            log = work / f"gateway-{workers}.log"
            gateways[workers] = stack.enter_context(
                running(command, port, "/v1/models", log, f"gateway ({workers} workers)")
            )
        for round_ in range(args.rounds):
            for level in levels:
                order = ("1", "2") if (round_ + levels.index(level)) % 2 == 0 else ("2", "1")
                for workers in order:
                    print(f"round {round_ + 1}: {level}, {workers} worker(s)", file=sys.stderr,
                          flush=True)  # fmt: skip
                    found = measure(gateways[workers], level, args.seconds, redis_client, nginx_)
                    runs[level][workers].append(found)
    return {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}",
        "load_before": load_before,
        "ledger": args.ledger,
        "tokenizer": args.tokenizer,
        "rounds": args.rounds,
        "seconds": args.seconds,
        "levels": {level: summary(found) for level, found in runs.items()},
        "runs": runs,
    }


def summary(found: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    medians = {
        workers: {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        for workers, rounds in found.items()
    }
    ratios = [
        two["requests_per_s"] / one["requests_per_s"]
        for one, two in zip(found["1"], found["2"], strict=True)
    ]
    return {**medians, "ratio": statistics.median(ratios), "ratios": ratios}


def markdown(report: dict[str, Any]) -> str:
    columns = (
        ("load", None, 0), ("workers", None, 0), ("requests/s", "requests_per_s", 0),
        ("tokens/s", "tokens_per_s", 0), ("ratio to 1 worker", None, 0),
        ("gateway µs/request", "gateway_us_per_request", 0), ("gateway cores", "gateway_cores", 2),
        ("wrk cores", "wrk_cores", 2), ("Redis cores", "redis_cores", 2),
        ("nginx cores", "nginx_cores", 2), ("collector cores", "collector_cores", 2),
        ("busiest worker cores", "busiest_worker_cores", 2),
        ("idlest worker cores", "idlest_worker_cores", 2), ("machine idle cores", "idle_cores", 2),
        ("p50 ms", "p50_ms", 1),
    )  # fmt: skip
    rows: list[list[str]] = []
    for level, found in report["levels"].items():
        kind, connections = level.split(":")
        load = f"{'streams of 256 tokens' if kind == 'stream' else 'non-stream'}, {connections}"
        for workers in ("1", "2"):
            values = found[workers]
            ratio = "" if workers == "1" else (
                f"{found['ratio']:.2f} ({', '.join(f'{r:.2f}' for r in found['ratios'])})"
            )  # fmt: skip
            rows.append([load, workers, *(
                ratio if key is None else cell(values[key], digits)
                for _, key, digits in columns[2:]
            )])  # fmt: skip
    intro = (
        f"Run {report['when']} on {report['machine']}; load average before: "
        f"{report['load_before']:.2f}; {report['rounds']} rounds of {report['seconds']} s a "
        "level, medians (the ratio: median of the rounds' ratios, each round's in brackets). "
        f"All on ({all_on_choice(report)}), load from wrk, answers from nginx."
    )
    return "\n".join([intro, "", *table(columns, rows)]) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=15)
    parser.add_argument("--levels", default="plain:64,stream:64,stream:256")
    parser.add_argument("--repeats", type=int, help="run.py's name for --rounds")
    parser.add_argument("--ledger", choices=["sqlite", "redis"], default="sqlite")
    parser.add_argument("--tokenizer", choices=["qwen", "o200k"], default="qwen")
    args = parser.parse_args()
    if args.repeats is not None:
        args.rounds = args.repeats
    report = run_suite(args)
    suffix = "-redis-ledger" if args.ledger == "redis" else ""
    suffix += "-o200k" if args.tokenizer == "o200k" else ""
    publish(f"workers-scale{suffix}", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
