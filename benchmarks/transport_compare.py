"""Client-side CPU cost of httpx's and httpx2's default transports vs PooledTransport, against
the mock backend.

    python benchmarks/transport_compare.py [--requests 2000] [--concurrency 64] [--streams 64]
        [--events 256] [--paced-tps 1000] [--repeats 3] [--loop uvloop|asyncio]
        [--kinds httpx,httpx2,pooled] [--on-httpx2]

`httpx` is httpx 0.28's AsyncClient on its default pool (httpcore), `httpx2` the same on httpx2's
(httpcore2, what the openai SDK now uses), `pooled` tokenweir's own transport behind an httpx
AsyncClient; all three pools are sized to the load. `--on-httpx2` runs it all with `import httpx`
resolving to httpx2 (`httpx2.alias_httpx()`): `pooled` is then the own transport, unchanged,
speaking httpx2's types (what a migration would run), and `httpx` is httpx2 too.
Starts `tokenweir mock-backend --tokens-per-second inf` in a subprocess, then in this process
sends the non-stream requests (at the given concurrency) and the concurrent SSE streams through
each transport in turn, `--repeats` times, alternating. Unpaced, a whole stream arrives in a few
reads; a second mock paced at `--paced-tps` tokens/s per stream shows the per-read cost (one
event per read). CPU time is this process's `time.process_time()` around each run: the client
side only. Prints medians.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx2

if "--on-httpx2" in sys.argv:  # before anything imports httpx
    httpx2.alias_httpx()

import httpx
import uvloop

from proxy.upstream.transport import PooledTransport

TIMEOUT = httpx.Timeout(30.0, connect=5.0)
# The three clients have the same methods; httpx2's are its own classes, not httpx's.
Client = httpx.AsyncClient | httpx2.AsyncClient


@dataclass(frozen=True)
class Load:
    requests: int
    concurrency: int
    streams: int
    events: int


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def mock_backend(tokens_per_second: float) -> Iterator[str]:
    port = free_port()
    command = [sys.executable, "-m", "proxy", "mock-backend"]
    command += ["--tokens-per-second", str(tokens_per_second)]
    quiet = subprocess.DEVNULL
    process = subprocess.Popen([*command, "--port", str(port)], stdout=quiet, stderr=quiet)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                httpx.get(url + "/v1/models", timeout=1).raise_for_status()
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("the mock backend did not start") from None
                time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


def body(load: Load, *, stream: bool) -> dict[str, object]:
    return {
        "model": "mock-llm",
        "messages": [{"role": "user", "content": "Benchmark the transport, please."}],
        "stream": stream,
        "mock_completion_tokens": load.events if stream else 64,
    }


async def non_stream(client: Client, url: str, load: Load) -> int:
    remaining = load.requests
    payload = body(load, stream=False)

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            response = await client.post(url + "/v1/chat/completions", json=payload)
            response.raise_for_status()

    await asyncio.gather(*(worker() for _ in range(load.concurrency)))
    return load.requests


async def stream_reads(client: Client, url: str, load: Load) -> tuple[int, int]:
    """Events and reads (chunks handed out by the transport) over all streams."""
    payload = body(load, stream=True)

    async def one() -> tuple[int, int]:
        events = reads = 0
        async with client.stream("POST", url + "/v1/chat/completions", json=payload) as answer:
            answer.raise_for_status()
            async for raw in answer.aiter_raw():
                events += raw.count(b"\n\n")
                reads += 1
        return events, reads

    counts = await asyncio.gather(*(one() for _ in range(load.streams)))
    return sum(events for events, _ in counts), sum(reads for _, reads in counts)


async def streams(client: Client, url: str, load: Load) -> int:
    return (await stream_reads(client, url, load))[0]


async def reads(client: Client, url: str, load: Load) -> int:
    return (await stream_reads(client, url, load))[1]


def make_client(kind: str, load: Load) -> Client:
    connections = max(load.concurrency, load.streams)
    if kind == "httpx":
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        return httpx.AsyncClient(timeout=TIMEOUT, limits=limits)
    if kind == "httpx2":
        limits2 = httpx2.Limits(max_connections=connections, max_keepalive_connections=connections)
        return httpx2.AsyncClient(timeout=httpx2.Timeout(30.0, connect=5.0), limits=limits2)
    transport = PooledTransport(
        connect_timeout_s=5.0,
        read_timeout_s=30.0,
        write_timeout_s=30.0,
        pool_timeout_s=30.0,
        max_connections=connections,
    )
    return httpx.AsyncClient(timeout=TIMEOUT, transport=transport)


Run = Callable[[Client, str, Load], Awaitable[int]]


async def measure(kind: str, run: Run, url: str, load: Load) -> tuple[float, float, int]:
    """CPU seconds and wall seconds of one run on a warmed-up client, and its unit count."""
    async with make_client(kind, load) as client:
        await run(client, url, Load(load.concurrency, load.concurrency, 4, load.events))
        cpu_s, wall_s = time.process_time(), time.perf_counter()
        units = await run(client, url, load)
        return time.process_time() - cpu_s, time.perf_counter() - wall_s, units


async def compare(url: str, paced_url: str, load: Load, repeats: int, kinds: list[str]) -> None:
    scenarios: tuple[tuple[str, Run, str, str], ...] = (
        ("non-stream", non_stream, "request", url),
        ("stream", streams, "event", url),
        ("paced", reads, "read", paced_url),
    )
    for label, run, unit, target in scenarios:
        results: dict[str, list[tuple[float, float, int]]] = {kind: [] for kind in kinds}
        for repeat in range(repeats):
            order = kinds if repeat % 2 == 0 else kinds[::-1]  # nobody always goes first
            for kind in order:
                results[kind].append(await measure(kind, run, target, load))
        for kind, runs in results.items():
            per_unit_us = statistics.median(cpu / units * 1e6 for cpu, _, units in runs)
            rate = statistics.median(units / wall for _, wall, units in runs)
            print(
                f"{label:10} {kind:7} {per_unit_us:8.1f} µs CPU per {unit:7}"
                f" {rate:10,.0f} {unit}s/s wall  ({runs[0][2]:,} {unit}s per run)"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--events", type=int, default=256)
    parser.add_argument("--paced-tps", type=float, default=1000.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    parser.add_argument("--kinds", default="httpx,httpx2,pooled")
    parser.add_argument("--on-httpx2", action="store_true", help="httpx resolves to httpx2")
    args = parser.parse_args()
    load = Load(args.requests, args.concurrency, args.streams, args.events)
    loop_factory = uvloop.new_event_loop if args.loop == "uvloop" else asyncio.new_event_loop
    print(
        f"loop: {args.loop}, python {sys.version.split()[0]}, httpx {httpx.__version__} "
        f"({httpx.__name__}), httpx2 {httpx2.__version__}"
    )
    with (
        mock_backend(float("inf")) as url,
        mock_backend(args.paced_tps) as paced_url,
        asyncio.Runner(loop_factory=loop_factory) as runner,
    ):
        runner.run(compare(url, paced_url, load, args.repeats, args.kinds.split(",")))


if __name__ == "__main__":
    main()
