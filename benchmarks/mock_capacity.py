"""Can the mock backend pace N concurrent streams at T tokens/s each on one core?

Runs `proxy.tools.mock.backend.run` (uvloop + httptools) pinned to core 0 with `taskset`, drives
the streams from this process pinned to core 1 over raw asyncio sockets, and counts tokens by
counting `data: ` lines. Usage: python benchmarks/mock_capacity.py [--streams 64] [--tps 750]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import orjson
import uvloop

REPO = Path(__file__).resolve().parent.parent
SERVER_CORE = 0
CLIENT_CORE = 1


@dataclass(slots=True)
class StreamResult:
    """Client-side timings of one stream; every time is from time.perf_counter()."""

    sent_s: float = 0.0
    first_s: float | None = None
    done_s: float | None = None
    events: int = 0
    reads: int = 0
    max_lag_s: float = 0.0
    error: str | None = None


@dataclass(slots=True)
class StreamProtocol(asyncio.Protocol):
    """Reads one SSE response; records when tokens arrive and how late they are on schedule."""

    request: bytes
    tps: float
    result: StreamResult = field(default_factory=StreamResult)
    finished: asyncio.Future[None] | None = None
    _headers_done: bool = False
    _carry: bytes = b""
    _transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.result.sent_s = time.perf_counter()
        self._transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self.result.reads += 1
        data = self._carry + data
        if not self._headers_done:
            head, sep, data = data.partition(b"\r\n\r\n")
            if not sep:
                self._carry = head
                return
            if not head.startswith(b"HTTP/1.1 200"):
                self._finish(f"bad status: {head.splitlines()[0]!r}")
                return
            self._headers_done = True
        # Keep the last 5 bytes: a `data: ` marker may straddle two reads.
        self.result.events += data[:-5].count(b"data: ") if len(data) > 5 else 0
        self._carry = data[-5:]
        self._track(now)
        if b"[DONE]" in data:
            self.result.events += self._carry.count(b"data: ")
            self.result.done_s = now
            self._finish(None)

    def _track(self, now: float) -> None:
        tokens = self.result.events - 1  # the role event carries no token
        if tokens <= 0:
            return
        if self.result.first_s is None:
            self.result.first_s = now
        due = int((now - self.result.first_s) * self.tps) + 1
        self.result.max_lag_s = max(self.result.max_lag_s, (due - tokens) / self.tps)

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(f"connection lost: {exc}" if self.result.done_s is None else None)

    def _finish(self, error: str | None) -> None:
        if self.finished is not None and not self.finished.done():
            self.result.error = error
            self.finished.set_result(None)
        if self._transport is not None:
            self._transport.close()


def _request(port: int, index: int, tokens: int) -> bytes:
    body = orjson.dumps(
        {
            "model": "mock-llm",
            "messages": [{"role": "user", "content": f"capacity stream {index}"}],
            "max_tokens": tokens,
            "mock_completion_tokens": tokens,
            "stream": True,
        }
    )
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


async def _connect(loop: asyncio.AbstractEventLoop, protocol: StreamProtocol, port: int) -> None:
    await loop.create_connection(lambda: protocol, "127.0.0.1", port)


async def _drive(port: int, streams: int, tps: float, tokens: int) -> list[StreamResult]:
    loop = asyncio.get_running_loop()
    protocols = [StreamProtocol(_request(port, i, tokens), tps) for i in range(streams)]
    for protocol in protocols:
        protocol.finished = loop.create_future()
    await asyncio.gather(*(_connect(loop, protocol, port) for protocol in protocols))
    timeout_s = 30 + 2 * tokens / tps
    await asyncio.wait_for(
        asyncio.gather(*(p.finished for p in protocols if p.finished)), timeout_s
    )
    return [p.result for p in protocols]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _start_server(port: int, ttft_ms: float, tps: float) -> subprocess.Popen[bytes]:
    code = (
        "from proxy.tools.mock.server import run; "
        f"run(port={port}, ttft_ms={ttft_ms}, tokens_per_second={tps})"
    )
    cmd = ["taskset", "-c", str(SERVER_CORE), sys.executable, "-c", code]
    server = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return server
        except OSError:
            time.sleep(0.05)
    server.kill()
    raise RuntimeError("mock backend did not start")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(values: list[float]) -> str:
    return (
        f"median {statistics.median(values):.1f}  p10 {_quantile(values, 0.1):.1f}  "
        f"p90 {_quantile(values, 0.9):.1f}  min {min(values):.1f}  max {max(values):.1f}"
    )


def _report(results: list[StreamResult], args: argparse.Namespace, wall_s: float) -> bool:
    for r in results:
        if r.error is not None:
            print(f"  stream error: {r.error}")
    good = [r for r in results if r.error is None and r.first_s and r.done_s]
    if not good:
        return False
    tokens = [r.events - 2 for r in good]  # minus the role event and [DONE]
    rates = [
        (n - 1) / ((r.done_s or 0) - (r.first_s or 0)) for n, r in zip(tokens, good, strict=True)
    ]
    ttfts_ms = [1000 * ((r.first_s or 0) - r.sent_s) for r in good]
    reads = statistics.mean(r.reads for r in good)
    print(f"streams ok: {len(good)}/{len(results)}, tokens per stream {min(tokens)}..{max(tokens)}")
    print(f"tokens/s per stream (configured {args.tps:g}): {_summary(rates)}")
    print(f"aggregate: {sum(tokens) / wall_s:,.0f} tokens/s over {wall_s:.2f} s of wall time")
    print(f"TTFT ms (configured {args.ttft_ms:g}): {_summary(ttfts_ms)}")
    print(
        f"worst lag behind schedule per stream, ms: {_summary([1000 * r.max_lag_s for r in good])}"
    )
    print(
        f"client reads per stream: {reads:.0f} ({statistics.mean(tokens) / reads:.2f} tokens each)"
    )
    rate_ok = _quantile(rates, 0.1) >= 0.97 * args.tps
    ttft_ok = statistics.median(ttfts_ms) <= args.ttft_ms + 25
    print(f"rate: {'OK' if rate_ok else 'BEHIND'} (p10 within 3% of configured)")
    print(f"TTFT: {'OK' if ttft_ok else 'LATE'} (median within 25 ms of configured)")
    return len(good) == len(results) and rate_ok and ttft_ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tps", type=float, default=750.0, help="tokens/s per stream")
    parser.add_argument("--ttft-ms", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=5.0, help="stream length in seconds")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity") and CLIENT_CORE in os.sched_getaffinity(0):
        os.sched_setaffinity(0, {CLIENT_CORE})
    port = _free_port()
    server = _start_server(port, args.ttft_ms, args.tps)
    tokens = round(args.seconds * args.tps)
    try:
        uvloop.run(_drive(port, 1, args.tps, 10))  # warm-up: first-request costs are not capacity
        cpu0, client0, start = _cpu_s(server.pid), time.process_time(), time.perf_counter()
        results = uvloop.run(_drive(port, args.streams, args.tps, tokens))
        wall_s = time.perf_counter() - start
        server_cpu = (_cpu_s(server.pid) - cpu0) / wall_s
        client_cpu = (time.process_time() - client0) / wall_s
    finally:
        server.terminate()
        server.wait(timeout=10)
    print(
        f"{args.streams} streams x {tokens} tokens, {args.tps:g} tokens/s, TTFT {args.ttft_ms:g} ms"
    )
    print(
        f"CPU busy: server {server_cpu:.0%} of core {SERVER_CORE}, client {client_cpu:.0%} of core"
        f" {CLIENT_CORE}"
    )
    return 0 if _report(results, args, wall_s) else 1


if __name__ == "__main__":
    sys.exit(main())
