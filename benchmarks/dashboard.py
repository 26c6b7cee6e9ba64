"""Dashboard speed: overview, tenant page and /api/usage over a ledger of 1 million records.

    python benchmarks/dashboard.py [--repeats 3] [--records 1000000] [--requests 20]

Writes `--records` records (50 tenants, Zipf-like, 30 days, 4 models on 2 backends; the same
generator as benchmarks/ledger_append.py) through the SQLite ledger's writer, then starts
`tokenweir serve` on that ledger (a policy naming all 50 tenants, with budgets) and times HTTP
GETs from this process, one at a time: the admin overview (every tenant, 24 h), one tenant's page
(24 h by hour) and its 30-day page (by day), and /api/usage for every tenant over 30 days by
day. Each repeat sends `--requests` of each after one warm-up; medians of the repeats' p50 and
p90 are reported. Results: benchmarks/results/dashboard.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import quote

import httpx
from harness import KEY, RESULTS, Samples, started
from ledger_append import make_records

from proxy.ledger import SqliteLedger
from proxy.policy.units import hash_key

TENANTS = [f"tenant-{i:02d}" for i in range(49)] + ["客服机器人"]
VIEWS = {
    "admin overview, 50 tenants, 24 h": "/dashboard",
    "tenant page, busiest tenant, 24 h by hour": "/dashboard/tenants/tenant-00",
    "tenant page, busiest tenant, 30 days by day": "/dashboard/tenants/tenant-00?since=30d",
    "tenant page, Chinese-named tenant, 24 h": "/dashboard/tenants/" + quote("客服机器人"),
    "/api/usage, every tenant, 30 days by day": "/api/usage?since=30d&bucket=day",
}


def write_policy(directory: Path, ledger: Path) -> Path:
    tenants = "".join(
        f"  {json.dumps(name, ensure_ascii=False)}: {{api_keys: [{hash_key('k-' + name)}], "
        f"models: [mock-llm], budget: {{usd_per_day: 5, usd_per_month: 100}}}}\n"
        for name in TENANTS
    )
    path = directory / "dashboard-policy.yaml"
    path.write_text(
        f"storage: memory\nadmin_keys: [{hash_key(KEY)}]\nledger: sqlite:///{ledger}\n"
        'backends: [{name: mock, url: "http://127.0.0.1:9/v1", models: [mock-llm]}]\n'
        f"models: {{mock-llm: {{}}}}\ntenants:\n{tenants}",
        encoding="utf-8",
    )
    return path


async def fill(path: Path, count: int) -> float:
    records = make_records(count, now=time.time(), days=30)
    ledger = SqliteLedger(path, buffer_records=count + 1, flush_timeout_s=3600)
    await ledger.start()
    began = time.perf_counter()
    for start in range(0, count, 10_000):
        for record in records[start : start + 10_000]:
            ledger.append(record)
        await asyncio.sleep(0)
    await ledger.aclose()
    return time.perf_counter() - began


def timed(client: httpx.Client, path: str, requests: int) -> tuple[float, float]:
    """(p50, p90) in ms of `requests` GETs after one warm-up."""
    client.get(path).raise_for_status()
    times = []
    for _ in range(requests):
        began = time.perf_counter()
        answer = client.get(path)
        times.append((time.perf_counter() - began) * 1000)
        answer.raise_for_status()
    cuts = statistics.quantiles(times, n=10)
    return statistics.median(times), cuts[8]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=20)
    args = parser.parse_args()
    samples = Samples()
    with tempfile.TemporaryDirectory() as tmp:
        ledger = Path(tmp) / "ledger.db"
        write_s = asyncio.run(fill(ledger, args.records))
        gc.collect()
        print(
            f"wrote {args.records:,} records in {write_s:.1f} s "
            f"({ledger.stat().st_size / 1e6:.0f} MB)"
        )
        policy = write_policy(Path(tmp), ledger)
        serve = ["serve", "--config", str(policy), "--no-access-log"]
        with started(serve, "/healthz", Path(tmp) / "serve.log") as gateway:
            headers = {"authorization": f"Bearer {KEY}"}
            with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as client:
                for repeat in range(args.repeats):
                    for name, path in VIEWS.items():
                        p50, p90 = timed(client, path, args.requests)
                        samples.add(f"{name} p50", p50)
                        samples.add(f"{name} p90", p90)
                        print(
                            f"repeat {repeat + 1}: {name:<46} p50 {p50:7.1f} ms  p90 {p90:7.1f} ms"
                        )
    results = {name: samples.median(name) for name in samples.values}
    RESULTS.mkdir(exist_ok=True)
    meta = {"records": args.records, "repeats": args.repeats, "requests": args.requests}
    (RESULTS / "dashboard.json").write_text(json.dumps(meta | {"results": results}, indent=2))
    (RESULTS / "dashboard.md").write_text(table(results, args), encoding="utf-8")
    print(table(results, args))


def table(results: dict[str, float | None], args: argparse.Namespace) -> str:
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M")
    lines = [
        f"Run {when} UTC, {args.records:,} ledger records (SQLite), {args.repeats} repeats of "
        f"{args.requests} requests each, medians.",
        "",
        "| view (HTTP GET, end to end, one at a time) | p50 ms | p90 ms |",
        "|---|---:|---:|",
    ]
    for name in VIEWS:
        p50, p90 = results.get(f"{name} p50"), results.get(f"{name} p90")
        lines.append(f"| {name} | {p50 or 0:.1f} | {p90 or 0:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
