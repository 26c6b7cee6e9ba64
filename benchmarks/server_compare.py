"""The same gateway served by uvicorn (`tokenweir serve`) and by granian, side by side, one run.

    python benchmarks/server_compare.py [--repeats 5] [--levels 1,16,64] [--tokens 256]
                                        [--tps 750] [--features off,all] [--servers uvicorn,granian]

For each feature set (`off`: auth only; `all`: everything `overhead.py --features all` turns on,
on a private Redis, with traces and metrics exported to a stand-in collector), one paced
mock backend and one unpaced one are started, and in front of each the gateway twice: once as
`tokenweir serve` (uvicorn, httptools, uvloop, one process) and once under granian (its ASGI
interface, `--loop uvloop`, one worker, HTTP/1, the same policy, log config and timeouts).
Every repeat runs each level direct and through each server in turn (overhead.py's
`stream_level`/`non_stream_level`, one repeat per call, alternating servers), and reports
medians over the repeats: gateway CPU µs per streamed token (the whole process tree: granian's
supervisor and worker), added TTFT p50, per-stream tok/s ratio, non-stream requests/s.
Results: benchmarks/results/server-compare.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import (
    TICKS_PER_S,
    Process,
    cell,
    cpu_ticks,
    free_port,
    publish,
    started,
    table,
    wait_answering,
    warm_up,
)
from otelsink import otlp_sink, scraping
from overhead import TELEMETRY_ENV, gateway_config, non_stream_level, stream_level

from proxy.app import SESSION_SECRET_ENV
from proxy.reload import WATCH_ENV
from proxy.telemetry.logs import log_config
from tests.redis_server import private_redis

# What `tokenweir serve` gives uvicorn, in granian's terms (see docs/benchmarks.md, point 4):
# header timeout 10 s (the policy default), a kill timeout past the 30 s drain, HTTP/1 only.
GRANIAN_ARGS = [
    "--interface", "asgi", "--factory", "--loop", "uvloop", "--workers", "1", "--http", "1",
    "--no-ws", "--http1-header-read-timeout", "10000", "--workers-kill-timeout", "35",
]  # fmt: skip


@dataclass
class ProcessTree(Process):
    """A server whose work happens in child processes too (granian's worker): CPU and RSS of
    the supervisor and every descendant."""

    def pids(self) -> list[int]:
        found, todo = [], [self.popen.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            with contextlib.suppress(OSError):
                for task in Path(f"/proc/{pid}/task").iterdir():
                    todo += [int(c) for c in (task / "children").read_text().split()]
        return found

    def cpu_s(self) -> float:
        total = 0.0
        for pid in self.pids():
            with contextlib.suppress(OSError):
                total += cpu_ticks(Path(f"/proc/{pid}/stat")) / TICKS_PER_S
        return total

    def memory_mb(self) -> dict[str, float]:
        """RSS of the tree (the supervisor's included: it is part of the server's cost)."""
        rss = peak = 0.0
        for pid in self.pids():
            with contextlib.suppress(OSError):
                status = Path(f"/proc/{pid}/status").read_text().splitlines()
                values = {ln.split(":")[0]: ln.split()[1] for ln in status if ln.startswith("Vm")}
                rss += int(values["VmRSS"]) / 1024
                peak += int(values["VmHWM"]) / 1024
        return {"rss_mb": rss, "peak_rss_mb": peak}


def granian_command(port: int, log_json: Path, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        sys.executable, "-m", "granian", *GRANIAN_ARGS, *extra, "--host", "127.0.0.1",
        "--port", str(port), "--log-config", str(log_json), "proxy.app:create_served_app",
    ]  # fmt: skip


@contextmanager
def granian_started(
    config: Path, log: Path, *, extra: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> Iterator[ProcessTree]:
    """The gateway on `config` under granian, as `tokenweir serve` would set its environment."""
    port = free_port()
    log_json = log.with_suffix(".logging.json")
    log_json.write_text(json.dumps(log_config("info")))
    environment = {
        **os.environ, "TOKENWEIR_CONFIG": str(config), WATCH_ENV: "0",
        SESSION_SECRET_ENV: os.environ.get(SESSION_SECRET_ENV, "bench-session-secret"),
        **(env or {}),
    }  # fmt: skip
    with log.open("wb") as out:
        popen = subprocess.Popen(
            granian_command(port, log_json, extra), stdout=out, stderr=subprocess.STDOUT,
            env=environment,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_answering(url + "/healthz", popen, f"granian did not start; see {log}")
        yield ProcessTree(popen, url)
    finally:
        popen.terminate()
        popen.wait(timeout=60)


Launch = Callable[[Path, Path], contextlib.AbstractContextManager[Process]]


def uvicorn_started(config: Path, log: Path) -> contextlib.AbstractContextManager[Process]:
    return started(["serve", "--config", str(config)], "/healthz", log)


SERVERS: dict[str, Launch] = {
    "uvicorn": uvicorn_started,
    "granian": lambda config, log: granian_started(config, log),
    # Granian's Rust task implementation (asyncio-compatible tasks run from Rust).
    "granian-rust-tasks": lambda config, log: granian_started(
        config, log, extra=("--task-impl", "rust")
    ),
}


def _merge(runs: list[dict[str, float | None]]) -> dict[str, float | None]:
    """Medians over repeats of per-repeat results (each itself one repeat)."""
    names = {name for run in runs for name in run}
    merged: dict[str, float | None] = {}
    for name in sorted(names):
        values = [v for run in runs if (v := run.get(name)) is not None]
        merged[name] = statistics.median(values) if values else None
    return merged


def run_features(args: argparse.Namespace, features: str, work: Path) -> dict[str, Any]:
    """Streams, then non-stream, through every server, for one feature set."""
    with contextlib.ExitStack() as stack:
        redis_url = stack.enter_context(private_redis()) if features == "all" else None
        result: dict[str, Any] = {"stream": {}, "non_stream": {}}
        for tps, part in ((str(args.tps), "stream"), ("inf", "non_stream")):
            with contextlib.ExitStack() as servers:
                mock = servers.enter_context(
                    started(["mock-backend", "--tokens-per-second", tps], "/v1/models",
                            work / f"mock-{features}-{part}.log")
                )  # fmt: skip
                config = gateway_config(mock.url, work, redis_url)
                gateways = {
                    name: servers.enter_context(
                        SERVERS[name](config, work / f"{name}-{features}-{part}.log")
                    )
                    for name in args.servers.split(",")
                }
                for gateway in gateways.values():
                    servers.enter_context(scraping(gateway.url, features != "off"))
                warm_up(mock, *gateways.values())
                result[part] = measure_part(args, part, mock, gateways)
        return result


def measure_part(
    args: argparse.Namespace, part: str, mock: Process, gateways: dict[str, Process]
) -> dict[str, Any]:
    if part == "non_stream":
        runs: dict[str, list[dict[str, float | None]]] = {name: [] for name in gateways}
        for repeat in range(args.repeats):
            print(f"  non-stream, repeat {repeat + 1}", file=sys.stderr, flush=True)
            for name, gateway in gateways.items():
                runs[name].append(non_stream_level(mock, gateway, 1))
        return {name: _merge(found) for name, found in runs.items()}
    levels: dict[int, dict[str, Any]] = {}
    for level in (int(x) for x in args.levels.split(",")):
        per_server: dict[str, list[dict[str, float | None]]] = {name: [] for name in gateways}
        for repeat in range(args.repeats):
            print(f"  {level} streams, repeat {repeat + 1}", file=sys.stderr, flush=True)
            order = list(gateways.items())
            if repeat % 2:  # alternate who goes first: neither always runs on a warmer machine
                order.reverse()
            for name, gateway in order:
                per_server[name].append(stream_level(mock, gateway, level, 1, args.tokens))
        levels[level] = {name: _merge(found) for name, found in per_server.items()}
    return levels


STREAM_COLUMNS = (
    ("features", None, 0),
    ("streams", None, 0),
    ("server", None, 0),
    ("gateway CPU µs/token", "gateway_cpu_us_per_token", 1),
    ("added TTFT p50 ms", "added_ttft_p50", -2),
    ("added TTFT p99 ms", "added_ttft_p99", -2),
    ("per-stream tok/s ratio", "stream_tps_ratio", 3),
    ("aggregate ratio", "aggregate_ratio", 3),
    ("RSS MB", "rss_mb", 0),
)
NON_STREAM_COLUMNS = (
    ("features", None, 0),
    ("server", None, 0),
    ("direct req/s", "direct_rps", 0),
    ("via gateway req/s", "gateway_rps", 0),
    ("ratio", "rps_ratio", 3),
    ("gateway CPU µs/request", "gateway_cpu_us_per_request", 0),
    ("errors", "errors", 0),
)


def markdown(report: dict[str, Any]) -> str:
    stream_rows, non_stream_rows = [], []
    for features, found in report["features"].items():
        for level, servers in found["stream"].items():
            for name, row in servers.items():
                stream_rows.append(
                    [features, str(level), name,
                     *(cell(row.get(key), d) for _, key, d in STREAM_COLUMNS[3:] if key)]
                )  # fmt: skip
        for name, row in found["non_stream"].items():
            non_stream_rows.append(
                [features, name, *(cell(row.get(key), d) for _, key, d in NON_STREAM_COLUMNS[2:]
                                   if key)]
            )  # fmt: skip
    lines = [
        f"Run {report['when']} on {report['machine']}; {report['repeats']} repeats, medians; "
        f"{report['tokens']} tokens per stream at {report['tps']} tokens/s per stream; "
        f"granian {report['granian']}, uvicorn {report['uvicorn']}.",
        "",
        *table(STREAM_COLUMNS, stream_rows),
        "",
        "Non-stream, 64 concurrent requests of 16 tokens, unpaced backend:",
        "",
        *table(NON_STREAM_COLUMNS, non_stream_rows),
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--levels", default="1,16,64")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--tps", type=float, default=750.0)
    parser.add_argument("--features", default="off,all")
    parser.add_argument("--servers", default="uvicorn,granian")
    parser.add_argument("--name", default="server-compare", help="results file name")
    args = parser.parse_args()
    from importlib.metadata import version

    report: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}",
        "load": os.getloadavg(), "repeats": args.repeats, "tokens": args.tokens,
        "tps": args.tps, "granian": version("granian"), "uvicorn": version("uvicorn"),
        "features": {},
    }  # fmt: skip
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        if "all" in args.features.split(","):
            # Exported by every gateway of the run; the plain one ("off") has OTEL_* unset below.
            endpoint, _ = stack.enter_context(otlp_sink())
        for features in args.features.split(","):
            print(f"features: {features}", file=sys.stderr, flush=True)
            telemetry = TELEMETRY_ENV if features == "all" else {}
            for name in (*TELEMETRY_ENV, "OTEL_EXPORTER_OTLP_ENDPOINT"):
                os.environ.pop(name, None)
            if telemetry:
                os.environ.update(telemetry, OTEL_EXPORTER_OTLP_ENDPOINT=endpoint)
            report["features"][features] = run_features(args, features, Path(tmp))
    report["load_after"] = os.getloadavg()
    publish(args.name, report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
