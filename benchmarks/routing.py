"""Routing strategies on simulated replicas with a KV prefix cache: which one serves faster.

    python benchmarks/routing.py [--repeats 3] [--requests 320] [--concurrency 16]

Four `tokenweir mock-backend` replicas of one model, each simulating a vLLM/SGLang server:
TTFT = 20 ms + 8 ms per other request in flight + 250 ms per 1,000 prompt tokens whose KV is not
cached; the cache holds 4 system-prompt prefixes (LRU). The workload: 8 shared system prompts
(~1,200 tokens each) with short distinct questions, picked at random (same seed every run),
streamed, 32 tokens each at 200 tokens/s. One gateway per strategy, `prefix_affinity`,
`least_inflight` and round robin (`weighted`, equal weights), each on fresh replicas (cold
caches). Reported: mean and p50 TTFT at the client, aggregate output tokens/s, the replicas'
prefix-cache hit rate; medians over the repeats. Results: benchmarks/results/routing.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import httpx
from harness import KEY, Process, Samples, cell, publish, started, table

from proxy.policy.units import hash_key

STRATEGIES = ("prefix_affinity", "least_inflight", "weighted")
REPLICA_ARGS = [
    "mock-backend", "--ttft-ms", "20", "--tokens-per-second", "200", "--load-ttft-ms", "8",
    "--prefill-ms-per-1k-tokens", "250", "--prefix-cache", "4",
]  # fmt: skip
SYSTEM_WORDS = 1200
OUTPUT_TOKENS = 32


def system_prompts(count: int = 8) -> list[str]:
    rng = random.Random(11)
    words = ["policy", "refund", "order", "customer", "account", "shipping", "answer", "rule"]
    return [
        f"You are assistant #{i}. " + " ".join(rng.choice(words) for _ in range(SYSTEM_WORDS))
        for i in range(count)
    ]


def workload(requests: int) -> list[dict[str, Any]]:
    rng = random.Random(5)
    prompts = system_prompts()
    return [
        {
            "model": "mock-llm", "stream": True, "max_tokens": OUTPUT_TOKENS,
            "mock_completion_tokens": OUTPUT_TOKENS,
            "messages": [
                {"role": "system", "content": rng.choice(prompts)},
                {"role": "user", "content": f"question number {i} about my order"},
            ],
        }
        for i in range(requests)
    ]  # fmt: skip


def policy(replicas: list[Process], routing: str, directory: Path) -> Path:
    listed = "\n".join(
        f'  - {{name: r{i}, url: "{r.url}/v1", models: [mock-llm]}}' for i, r in enumerate(replicas)
    )
    path = directory / f"policy-{routing}.yaml"
    path.write_text(
        f"""
upstream: {{probe_interval: 0}}
backends:
{listed}
models:
  mock-llm: {{routing: {routing}}}
tenants:
  bench: {{api_keys: [{hash_key(KEY)}], models: [mock-llm]}}
"""
    )
    return path


async def drive(url: str, bodies: list[dict[str, Any]], concurrency: int) -> dict[str, float]:
    """Stream every body through `url` with `concurrency` in flight: TTFTs and tokens/s."""
    headers = {"authorization": f"Bearer {KEY}"}
    ttfts: list[float] = []
    tokens = 0
    queue = list(reversed(bodies))
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60, limits=limits) as http:

        async def worker() -> None:
            nonlocal tokens
            while queue:
                body = queue.pop()
                began = time.monotonic()
                first = None
                async with http.stream("POST", "/v1/chat/completions", json=body) as answer:
                    answer.raise_for_status()
                    async for line in answer.aiter_lines():
                        if line.startswith("data: {") and '"content":"' in line:
                            first = first or time.monotonic()
                            tokens += 1
                ttfts.append((first or time.monotonic()) - began)

        began = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall_s = time.monotonic() - began
    return {
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": statistics.median(ttfts),
        "tokens_per_s": tokens / wall_s,
    }


@contextmanager
def replicas(work: Path, tag: str) -> Iterator[list[Process]]:
    with ExitStack() as stack:
        yield [
            stack.enter_context(started(REPLICA_ARGS, "/v1/models", work / f"{tag}-r{i}.log"))
            for i in range(4)
        ]


def hit_rate(started_replicas: list[Process]) -> float:
    stats = [httpx.get(r.url + "/mock/stats").json() for r in started_replicas]
    hits = sum(s["prefix_hits"] for s in stats)
    return hits / max(1, hits + sum(s["prefix_misses"] for s in stats))


def run(repeats: int, requests: int, concurrency: int) -> dict[str, dict[str, float | None]]:
    samples = Samples()
    bodies = workload(requests)
    with TemporaryDirectory() as tmp:
        work = Path(tmp)
        for repeat in range(repeats):
            for routing in STRATEGIES:
                print(f"{routing} run {repeat + 1} ...", file=sys.stderr, flush=True)
                with replicas(work, f"{routing}-{repeat}") as pool:
                    config = policy(pool, routing, work)
                    serve = ["serve", "--config", str(config), "--no-access-log"]
                    with started(serve, "/healthz", work / f"gw-{routing}.log") as gateway:
                        result = asyncio.run(drive(gateway.url, bodies, concurrency))
                    result["prefix_hit_rate"] = hit_rate(pool)
                for name, value in result.items():
                    samples.add(f"{routing}:{name}", value)
    return {
        routing: {
            name: samples.median(f"{routing}:{name}")
            for name in ("ttft_mean_s", "ttft_p50_s", "tokens_per_s", "prefix_hit_rate")
        }
        for routing in STRATEGIES
    }


def markdown(report: dict[str, Any]) -> str:
    columns = (
        ("strategy", None, 0), ("mean TTFT ms", "ttft_mean_s", -1),
        ("p50 TTFT ms", "ttft_p50_s", -1), ("aggregate tokens/s", "tokens_per_s", 0),
        ("prefix-cache hits", "prefix_hit_rate", 2),
    )  # fmt: skip
    rows = [
        [("round robin (`weighted`)" if name == "weighted" else f"`{name}`")]
        + [cell(values[key], digits) for _, key, digits in columns[1:] if key]
        for name, values in report["strategies"].items()
    ]
    lines = [
        f"Measured {report['when']}: {report['requests']} streamed requests, "
        f"{report['concurrency']} in flight, 4 simulated replicas; medians of "
        f"{report['repeats']} runs on a shared 2-core machine.",
        "",
        *table(columns, rows),
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=320)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    report: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "repeats": args.repeats, "requests": args.requests, "concurrency": args.concurrency,
        "replica": REPLICA_ARGS,
    }  # fmt: skip
    report["strategies"] = run(args.repeats, args.requests, args.concurrency)
    publish("routing", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
