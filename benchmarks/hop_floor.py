"""What any proxy hop costs on this machine: the floor under tokenweir's TTFT and CPU targets.

    python benchmarks/hop_floor.py [--repeats 5] [--levels 1,16] [--tokens 256] [--tps 750]

One paced `tokenweir mock-backend`, and in front of it three relays, each driven by
`tokenweir bench` with the same streamed load as benchmarks/overhead.py, direct and through
each relay in turn (the order rotating every repeat), medians over the repeats:
- socat: a native TCP relay (`socat TCP-LISTEN,fork TCP`), no HTTP at all: what one more hop
  costs in the kernel and the scheduler alone;
- python: the least a Python relay can do (this file, `--relay`): uvloop, one upstream
  connection per client connection, bytes copied both ways, nothing parsed;
- tokenweir: `tokenweir serve`, auth only (overhead.py's bare gateway).
For each: added TTFT p50 (its TTFT minus the direct run's of the same repeat) and CPU µs per
streamed token (the relay's process and its children, reaped ones included, from /proc).
Results: benchmarks/results/hop-floor.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

from harness import (
    RESULTS,
    TICKS_PER_S,
    Process,
    Samples,
    bench,
    cell,
    free_port,
    policy_for,
    publish,
    running,
    started,
    stat_fields,
    table,
    warm_up,
)

RELAYS = ("socat", "python", "tokenweir")


def cpu_with_children_s(process: Process) -> float:
    """The process tree's CPU, with what its exited children used (socat forks one per
    connection, and a child's time moves to cutime/cstime when it is reaped)."""
    fields = stat_fields(Path(f"/proc/{process.popen.pid}/stat"))
    reaped = (int(fields[13]) + int(fields[14])) / TICKS_PER_S
    return process.cpu_s() + reaped


@contextlib.contextmanager
def relay(kind: str, target: str, log: Path) -> Iterator[Process]:
    port = free_port()
    upstream = target.rsplit(":", 1)[1]
    if kind == "socat":
        command = ["socat", f"TCP-LISTEN:{port},reuseaddr,fork,nodelay,bind=127.0.0.1",
                   f"TCP:127.0.0.1:{upstream},nodelay"]  # fmt: skip
    else:
        command = [sys.executable, __file__, "--relay", str(port), upstream]
    with running(command, port, "/v1/models", log, f"the {kind} relay") as process:
        yield process


def level_run(
    mock: Process, relays: dict[str, Process], concurrency: int, repeats: int, tokens: int
) -> dict[str, dict[str, float | None]]:
    requests = max(16, 4 * concurrency)
    samples = {name: Samples() for name in relays}
    for repeat in range(repeats):
        order = list(relays)[repeat % len(relays) :] + list(relays)[: repeat % len(relays)]
        direct = bench(mock.url, concurrency, requests, stream=True, tokens=tokens)
        for name in order:
            process = relays[name]
            before = cpu_with_children_s(process)
            through = bench(process.url, concurrency, requests, stream=True, tokens=tokens)
            cpu_s = cpu_with_children_s(process) - before
            found = samples[name]
            added_s = through["ttft_s"]["p50"] - direct["ttft_s"]["p50"]
            found.add("added_ttft_p50_ms", added_s * 1e3)
            found.add("direct_ttft_p50_ms", direct["ttft_s"]["p50"] * 1e3)
            if through["output_tokens"]:
                found.add("cpu_us_per_token", cpu_s / through["output_tokens"] * 1e6)
            found.add("errors", float(sum(through["errors"].values())))
    return {
        name: {key: found.median(key) for key in found.values} for name, found in samples.items()
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"Run {report['when']} on {report['machine']}; {report['repeats']} repeats, medians; "
        f"{report['tokens']} tokens a stream at {report['tps']:g} tok/s; load average before: "
        f"{report['load_before']}.",
        "",
    ]
    rows = []
    for level, found in report["levels"].items():
        for name in RELAYS:
            values = found[name]
            rows.append([
                str(level), name, cell(values.get("added_ttft_p50_ms"), 2),
                cell(values.get("cpu_us_per_token"), 1), cell(values.get("errors"), 0),
            ])  # fmt: skip
    columns = (("streams", None, 0), ("relay", None, 0), ("added TTFT p50 ms", None, 2),
               ("relay CPU µs/token", None, 1), ("errors", None, 0))  # fmt: skip
    return "\n".join(lines + table(columns, rows)) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--levels", default="1,16")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--tps", type=float, default=750.0)
    parser.add_argument("--relay", nargs=2, metavar=("PORT", "UPSTREAM_PORT"), type=int)
    args = parser.parse_args()
    if args.relay:
        serve_relay(*args.relay)
        return 0
    if shutil.which("socat") is None:
        parser.error("socat is not installed (apt-get install socat)")
    RESULTS.mkdir(exist_ok=True)
    report: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}",
        "load_before": round(os.getloadavg()[0], 2),
        "repeats": args.repeats, "tokens": args.tokens, "tps": args.tps, "levels": {},
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        paced = ["mock-backend", "--tokens-per-second", str(args.tps)]
        mock = stack.enter_context(started(paced, "/v1/models", work / "mock.log"))
        serve = ["serve", "--config", str(policy_for(mock.url, work))]
        relays = {
            "socat": stack.enter_context(relay("socat", mock.url, work / "socat.log")),
            "python": stack.enter_context(relay("python", mock.url, work / "python.log")),
            "tokenweir": stack.enter_context(started(serve, "/healthz", work / "gateway.log")),
        }
        warm_up(mock, *relays.values())
        for level in (int(x) for x in args.levels.split(",")):
            print(f"streams: {level} ...", file=sys.stderr, flush=True)
            report["levels"][level] = level_run(mock, relays, level, args.repeats, args.tokens)
    publish("hop-floor", report, markdown(report))
    return 0


class _Pipe(asyncio.Protocol):
    """One direction's reader: what it reads, its peer's transport writes."""

    def __init__(self) -> None:
        self.peer: asyncio.Transport | None = None
        self.held: list[bytes] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: TCP, not a subclass

    def data_received(self, data: bytes) -> None:
        if self.peer is None:
            self.held.append(data)
        else:
            self.peer.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None:
            self.peer.close()


class _Client(_Pipe):
    def __init__(self, upstream_port: int) -> None:
        super().__init__()
        self._upstream_port = upstream_port

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        upstream_transport, upstream = await loop.create_connection(
            _Pipe, "127.0.0.1", self._upstream_port
        )
        upstream.peer = self.transport
        for data in self.held:
            upstream_transport.write(data)
        self.held.clear()
        self.peer = upstream_transport


def serve_relay(port: int, upstream_port: int) -> None:
    import uvloop

    async def run() -> None:
        server = await asyncio.get_running_loop().create_server(
            lambda: _Client(upstream_port), "127.0.0.1", port
        )
        async with server:
            await server.serve_forever()

    uvloop.run(run())


if __name__ == "__main__":
    sys.exit(main())
