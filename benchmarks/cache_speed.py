"""Response-cache speed: an exact hit client to client, and a semantic lookup at 10k and 100k rows.

    python benchmarks/cache_speed.py [--repeats 3] [--requests 300] [--rows 10000,100000]

Exact hits: `tokenweir mock-backend` (TTFT 200 ms, 750 tokens/s) behind `tokenweir serve` with
`cache: {mode: exact}`, on memory storage and on a private Redis. One answer of 256 tokens is
cached, then the same request is sent again and again on one kept-alive connection from a
minimal blocking-socket client; each sample is request written -> last byte read (the whole
stream replay, `[DONE]` included). The first (miss) request's time is the contrast.
Semantic lookups: a partition filled with N random unit vectors (384 dimensions, as
all-MiniLM-L6-v2), then `SemanticIndex.nearest` timed for near-duplicate queries after the
mirror has caught up; the embedding call is excluded, as the issue says. On Redis the sample
includes the round trip that checks the partition for new rows.
Results: benchmarks/results/cache-speed.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from harness import KEY, Process, cell, policy_for, publish, redis_for, started, table

from proxy.cache.semantic import SemanticIndex
from proxy.cache.vectors import pack
from proxy.storage import CacheEntry, CacheStore, MemoryCacheStore, RedisCacheStore

DIM = 384
TOKENS = 256


def raw_request(port: int, *, stream: bool, run: int) -> bytes:
    body = json.dumps(
        {
            "model": "mock-llm",
            "messages": [{"role": "user", "content": f"Capital of France? ({stream=}, {run=})"}],
            "temperature": 0,
            "max_tokens": TOKENS,
            "mock_completion_tokens": TOKENS,
            "stream": stream,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
        f"authorization: Bearer {KEY}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def exchange(sock: socket.socket, request: bytes, *, stream: bool) -> tuple[float, bytes]:
    """Seconds from writing `request` to reading the answer's last byte, and the head."""
    started_s = time.perf_counter()
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    if stream:  # chunked transfer: the stream ends with [DONE] and the zero-length chunk
        while not rest.endswith(b"0\r\n\r\n"):
            rest += sock.recv(65536)
    else:
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        while len(rest) < length:
            rest += sock.recv(65536)
    return time.perf_counter() - started_s, head


def exact_hits(gateway: Process, requests: int, *, stream: bool, run: int) -> dict[str, float]:
    """A miss (a question new to the cache), then `requests` hits of the same question."""
    port = int(gateway.url.rsplit(":", 1)[1])
    request = raw_request(port, stream=stream, run=run)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        miss_s, head = exchange(sock, request, stream=stream)
        time.sleep(0.2)  # the miss is stored after its answer was sent
        cpu_before = gateway.cpu_s()
        samples = []
        for _ in range(requests):
            elapsed_s, head = exchange(sock, request, stream=stream)
            samples.append(elapsed_s)
        cpu_s = gateway.cpu_s() - cpu_before
    if b"x-tokenweir-cache: hit" not in head.lower():
        raise RuntimeError(f"expected a cache hit, got {head!r}")
    samples.sort()
    return {
        "miss_s": miss_s,
        "hit_p50_s": samples[len(samples) // 2],
        "hit_p90_s": samples[int(len(samples) * 0.9)],
        "gateway_cpu_per_hit_s": cpu_s / requests,
    }


async def fill(store: CacheStore, tenant: str, rows: np.ndarray) -> None:
    for start in range(0, len(rows), 500):
        vectors = [
            pack(rows[n], f"question {n}") for n in range(start, min(start + 500, len(rows)))
        ]
        entries = [
            CacheEntry(tenant, f"k{start + i}", b"answer", 0.0, 86400.0, 10**7, "p", vector)
            for i, vector in enumerate(vectors)
        ]
        puts = [store.put(entry) for entry in entries]
        await asyncio.gather(*puts)


async def semantic_lookups(
    store: CacheStore, tenant: str, rows: np.ndarray, queries: int
) -> dict[str, float]:
    index = SemanticIndex(store)
    rng = np.random.default_rng(7)
    picks = rng.integers(0, len(rows), queries)
    noise = rng.standard_normal((queries, DIM)).astype(np.float32) * 0.01
    near = rows[picks] + noise
    near /= np.linalg.norm(near, axis=1, keepdims=True)
    load_started = time.perf_counter()
    for _ in range(100_000):  # a big partition loads in the background; lookups miss meanwhile
        if await index.nearest(tenant, "p", near[0], f"question {picks[0]}", 0.5) is not None:
            break
        await asyncio.sleep(0.05)
    load_s = time.perf_counter() - load_started
    samples, found = [], 0
    for n, query in enumerate(near):
        started_s = time.perf_counter()
        match = await index.nearest(tenant, "p", query, f"question {picks[n]}", 0.9)
        samples.append(time.perf_counter() - started_s)
        found += match is not None and match.key == f"k{picks[n]}"
    samples.sort()
    return {
        "load_s": load_s,
        "p50_s": samples[len(samples) // 2],
        "p99_s": samples[int(len(samples) * 0.99)],
        "recall": found / queries,
    }


def unit_rows(n: int) -> np.ndarray:
    rows = np.random.default_rng(1).standard_normal((n, DIM)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


async def semantic_suite(sizes: list[int], redis_url: str, queries: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for size in sizes:
        rows = unit_rows(size)
        for name in ("memory", "redis"):
            store: CacheStore = (
                MemoryCacheStore() if name == "memory" else RedisCacheStore(redis_url)
            )
            print(f"semantic: {size} rows on {name} ...", file=sys.stderr, flush=True)
            tenant = f"bench-{size}"
            try:
                await fill(store, tenant, rows)
                out[f"{name}-{size}"] = await semantic_lookups(store, tenant, rows, queries)
            finally:
                await store.aclose()
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}",
        "repeats": args.repeats,
        "requests": args.requests,
        "exact": {},
    }
    with tempfile.TemporaryDirectory() as tmp, redis_for(None) as redis_url:
        work = Path(tmp)
        backend = ["mock-backend", "--ttft-ms", "200", "--tokens-per-second", "750"]
        with started(backend, "/v1/models", work / "mock.log") as mock:
            for storage in ("memory", redis_url):
                name = "memory" if storage == "memory" else "redis"
                config = policy_for(
                    mock.url, work, name=name, storage=storage, cache="{mode: exact}"
                )
                serve = ["serve", "--config", str(config)]
                with started(serve, "/healthz", work / f"gateway-{name}.log") as gateway:
                    for stream in (False, True):
                        runs = [
                            exact_hits(gateway, args.requests, stream=stream, run=run)
                            for run in range(args.repeats)
                        ]
                        key = f"{name}-{'stream' if stream else 'whole'}"
                        report["exact"][key] = {
                            field: statistics.median(r[field] for r in runs) for field in runs[0]
                        }
        sizes = [int(x) for x in args.rows.split(",")]
        report["semantic"] = asyncio.run(semantic_suite(sizes, redis_url, args.queries))
    return report


def markdown(report: dict[str, Any]) -> str:
    exact_rows = [
        [
            key,
            cell(r["miss_s"], -1),
            cell(r["hit_p50_s"], -3),
            cell(r["hit_p90_s"], -3),
            cell(r["gateway_cpu_per_hit_s"], -3),
        ]
        for key, r in report["exact"].items()
    ]
    semantic_rows = [
        [
            key,
            cell(r["load_s"], 1),
            cell(r["p50_s"], -3),
            cell(r["p99_s"], -3),
            f"{r['recall']:.3f}",
        ]
        for key, r in report["semantic"].items()
    ]
    lines = [
        f"Measured {report['when']} on {report['machine']}; medians of {report['repeats']} "
        f"runs of {report['requests']} hits each. Command: `python benchmarks/cache_speed.py`.",
        "",
        *table(
            (
                ("exact hit (storage, answer)", None, 0),
                ("miss ms", None, 0),
                ("hit p50 ms", None, 0),
                ("hit p90 ms", None, 0),
                ("gateway CPU ms/hit", None, 0),
            ),
            exact_rows,
        ),
        "",
        *table(
            (
                ("semantic (storage-rows)", None, 0),
                ("partition load s", None, 0),
                ("lookup p50 ms", None, 0),
                ("lookup p99 ms", None, 0),
                ("nearest found", None, 0),
            ),
            semantic_rows,
        ),
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rows", default="10000,100000")
    parser.add_argument("--queries", type=int, default=500)
    args = parser.parse_args()
    report = run(args)
    publish("cache-speed", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
