"""Rate limits' cost and accuracy: the same load without and with limits, in one run.

    python benchmarks/ratelimits.py [--repeats 3]

1. Latency: small non-stream requests one at a time through three gateways on one simulated
   backend: no limits; requests/tokens per minute and max_concurrent on memory; the same on a
   private local Redis (one Lua call admits, after the answer one more releases and settles).
2. Accuracy: three gateway processes on that Redis, requests_per_minute 300, a 10 s burst at 20x
   the limit's rate spread over them; admitted requests against what the limit allows (the
   burst plus the refill while sending).
Results: benchmarks/results/ratelimits.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from contextlib import AbstractContextManager
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import httpx
import redis
from harness import KEY, Process, Samples, bench, policy_for, publish, started, warm_up

from tests.redis_server import private_redis

LIMITS = "{requests_per_minute: 100000000, tokens_per_minute: 1000000000, max_concurrent: 1000}"
BODY = {"model": "mock-llm", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def latency(gateways: dict[str, Process], repeats: int) -> dict[str, float | None]:
    samples = Samples()
    for _ in range(repeats):
        for name, gateway in gateways.items():
            level = bench(gateway.url, 1, 400, stream=False, tokens=2)
            samples.add(f"{name}_p50", level["e2e_s"]["p50"])
            samples.add(f"{name}_p90", level["e2e_s"]["p90"])
    result = {name: samples.median(name) for name in samples.values}
    for name in ("memory", "redis"):
        plain, limited = result.get("plain_p50"), result.get(f"{name}_p50")
        result[f"{name}_added_p50"] = None if plain is None or limited is None else limited - plain
    return result


def accuracy(urls: list[str], limit: int, seconds: float, rate: float) -> dict[str, float]:
    async def burst() -> tuple[int, int, float]:
        headers = {"authorization": f"Bearer {KEY}"}
        clients = [httpx.AsyncClient(base_url=u, headers=headers, timeout=30) for u in urls]
        tasks = []
        began = time.monotonic()
        for i in range(int(seconds * rate)):
            await asyncio.sleep(max(0.0, began + i / rate - time.monotonic()))
            post = clients[i % len(clients)].post("/v1/chat/completions", json=BODY)
            tasks.append(asyncio.create_task(post))
        sent_for_s = time.monotonic() - began
        answers = await asyncio.gather(*tasks)
        for client in clients:
            await client.aclose()
        statuses = [a.status_code for a in answers]
        return statuses.count(200), statuses.count(429), sent_for_s

    admitted, refused, sent_for_s = asyncio.run(burst())
    allowed = limit + sent_for_s * limit / 60
    return {
        "sent": admitted + refused, "admitted": admitted, "allowed": allowed,
        "error_pct": (admitted - allowed) / allowed * 100,
    }  # fmt: skip


def markdown(report: dict[str, Any]) -> str:
    lat, acc = report["latency"], report["accuracy"]

    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value * 1000:.2f}"

    lines = [
        f"Run {report['when']}, {report['repeats']} repeats, medians.",
        "",
        "| small non-stream requests, one at a time | no limits | limits on memory "
        "| limits on Redis |",
        "|---|---:|---:|---:|",
        f"| end-to-end p50 ms | {ms(lat.get('plain_p50'))} | {ms(lat.get('memory_p50'))} "
        f"| {ms(lat.get('redis_p50'))} |",
        f"| end-to-end p90 ms | {ms(lat.get('plain_p90'))} | {ms(lat.get('memory_p90'))} "
        f"| {ms(lat.get('redis_p90'))} |",
        f"| added p50 ms | | {ms(lat.get('memory_added_p50'))} "
        f"| {ms(lat.get('redis_added_p50'))} |",
        "",
        "| 3 replicas on one Redis, requests_per_minute 300, 10 s at 20x | sent | admitted "
        "| allowed | error |",
        "|---|---:|---:|---:|---:|",
    ]
    for i, run in enumerate(acc, 1):
        lines.append(
            f"| run {i} | {run['sent']} | {run['admitted']} | {run['allowed']:.1f} "
            f"| {run['error_pct']:+.2f}% |"
        )
    return "\n".join(lines) + "\n"


def gateway(config: Path, log: Path) -> AbstractContextManager[Process]:
    return started(["serve", "--config", str(config)], "/healthz", log)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    report: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "repeats": args.repeats,
    }  # fmt: skip
    with TemporaryDirectory() as tmp, private_redis() as redis_url:
        work = Path(tmp)
        unpaced = ["mock-backend", "--tokens-per-second", "inf"]
        with started(unpaced, "/v1/models", work / "mock.log") as mock:
            configs = {
                "plain": policy_for(mock.url, work, name="plain"),
                "memory": policy_for(mock.url, work, name="memory", limits=LIMITS),
                "redis": policy_for(mock.url, work, name="redis", limits=LIMITS, storage=redis_url),
            }
            with (
                gateway(configs["plain"], work / "1.log") as a,
                gateway(configs["memory"], work / "2.log") as b,
                gateway(configs["redis"], work / "3.log") as c,
            ):
                gateways = {"plain": a, "memory": b, "redis": c}
                warm_up(a, b, c)
                print("latency ...", file=sys.stderr, flush=True)
                report["latency"] = latency(gateways, args.repeats)
            rpm = policy_for(
                mock.url, work, name="rpm", limits="{requests_per_minute: 300}", storage=redis_url
            )
            report["accuracy"] = []
            for run in range(args.repeats):
                with (
                    gateway(rpm, work / "r1.log") as r1,
                    gateway(rpm, work / "r2.log") as r2,
                    gateway(rpm, work / "r3.log") as r3,
                ):
                    print(f"accuracy run {run + 1} ...", file=sys.stderr, flush=True)
                    urls = [r1.url, r2.url, r3.url]
                    report["accuracy"].append(accuracy(urls, 300, 10.0, 100.0))
                with redis.Redis.from_url(redis_url) as admin:
                    admin.flushdb()  # the next run starts with a full bucket
    publish("ratelimits", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
