"""Does a burst of new entries slow other tenants' semantic lookups? (issue 18, point 3)

One tenant's partition holds `--size` entries (qqp_dev's duplicates plus filler, as in
semantic_engines.py); its `text_b` questions are asked in a loop, first alone, then while another
tenant stores a burst of `--burst` new entries at once (`store.put` for each, the vectors written by
the store's background writer, as the gateway does). Where the burst runs (`--modes`):

- `loop`: in the lookups' own event loop, its calls between theirs (one replica doing both);
- `process`: in a process of its own with its own store (another replica on the same Redis);
- `process-apart`: the same, storing into another Redis server (`--apart-url`) on this machine:
  nothing of the burst reaches the lookups' Redis, only the machine's cores are shared, so what
  it costs the lookups is the cost of two busy processes more on the same cores;
- `loop-entries`: in the lookups' loop, entries only, no vector (what storing answers costs
  without any vector write: the floor `loop` can come down to).

Lookups during a burst are told apart by when they ran: while its entries were being stored,
and after that, while only its vectors were still being written. Each burst is set beside a
quiet loop measured just before it; modes alternate, `--repeats`
times, and each figure is the median over the repeats (the quiet loops' p50 range shows how much
the shared machine alone moved it). Besides the lookups' latency as
the client sees it, Redis's side: its main thread's CPU share over the phase (INFO cpu) and the
lookup command's own time per call (INFO commandstats), so waiting in Redis can be told from
searching slower.

    bash ../shared/tools/redis8.sh start 6412
    python benchmarks/semantic_burst.py --redis-url redis://127.0.0.1:6412/0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from redis import Redis
from semantic_cache import DATA, RESULTS, engine_inputs, qqp_rows
from semantic_engines import PARTITION, TENANT, filler, load, warmed

from proxy.cache.semantic import SemanticIndex
from proxy.cache.vectors import pack
from proxy.policy.model import CacheSpec
from proxy.storage.cache import CacheEntry, Graph
from proxy.storage.redis.cache import RedisCacheStore

MODES = ("loop", "process", "process-apart", "loop-entries")
_LOOKUP_COMMAND = {"redis-search": "FT.SEARCH", "redis-vsets": "VSIM"}


@dataclass(frozen=True)
class Phase:
    """Lookups of one phase and what Redis did meanwhile."""

    took_ms: list[float]
    wall_s: float
    main_cpu_s: float
    lookup_usec: float

    def summary(self) -> dict[str, float]:
        busy = {
            "redis_main_busy": round(self.main_cpu_s / self.wall_s, 2),
            "lookup_usec": round(self.lookup_usec),
        }
        return latencies(self.took_ms) | busy


def latencies(took_ms: list[float]) -> dict[str, float]:
    """Count, p50, p95, p99 and max of lookup times (NaN for fewer than 20 lookups)."""
    if len(took_ms) < 20:
        nan = float("nan")
        return {"lookups": len(took_ms), "p50_ms": nan, "p95_ms": nan, "p99_ms": nan, "max_ms": nan}
    return {
        "lookups": len(took_ms),
        "p50_ms": round(statistics.median(took_ms), 3),
        "p95_ms": round(statistics.quantiles(took_ms, n=20)[18], 3),
        "p99_ms": round(statistics.quantiles(took_ms, n=100)[98], 3),
        "max_ms": round(max(took_ms), 1),
    }


class RedisSide:
    """Redis's main-thread CPU and the lookup command's time, read before and after a phase."""

    def __init__(self, url: str, engine: str) -> None:
        self._admin = Redis.from_url(url, decode_responses=True)
        self._command = _LOOKUP_COMMAND[engine]

    def read(self) -> tuple[float, float, int]:
        cpu = self._admin.info("cpu")
        stats = self._admin.info("commandstats").get(f"cmdstat_{self._command}", {})
        main = float(cpu["used_cpu_user_main_thread"]) + float(cpu["used_cpu_sys_main_thread"])
        return main, float(stats.get("usec", 0)), int(stats.get("calls", 0))

    def phase(self, before: tuple[float, float, int], took_ms: list[float], wall_s: float) -> Phase:
        main, usec, calls = self.read()
        per_call = (usec - before[1]) / max(1, calls - before[2])
        return Phase(took_ms, wall_s, main - before[0], per_call)

    def close(self) -> None:
        self._admin.close()


@dataclass(frozen=True)
class Asker:
    """The quiet tenant's lookups."""

    index: SemanticIndex
    spec: CacheSpec
    queries: np.ndarray

    async def rounds(self, rounds: int, queries: np.ndarray | None = None) -> list[float]:
        took_ms: list[float] = []
        for _ in range(rounds):
            for query in self.queries if queries is None else queries:
                began = time.perf_counter()
                await self.index.nearest(TENANT, PARTITION, query, "q", -1.0, self.spec)
                took_ms.append((time.perf_counter() - began) * 1000)
        return took_ms

    async def until(self, done: asyncio.Future[Any]) -> list[tuple[float, float]]:
        """The partition's first questions, over and over, until `done`: (seconds since the
        start, milliseconds taken) of each."""
        began = time.perf_counter()
        took: list[tuple[float, float]] = []
        while not done.done():
            for took_ms in await self.rounds(1, self.queries[:20]):
                took.append((time.perf_counter() - began, took_ms))
        return took


async def burst_rows(
    engine: str, cached: np.ndarray, queries: np.ndarray, args: argparse.Namespace
) -> list[dict[str, Any]]:
    for url in {args.redis_url, args.apart_url or args.redis_url}:
        with Redis.from_url(url) as admin:
            admin.flushdb()
    store = RedisCacheStore(args.redis_url)
    index = SemanticIndex(store)
    side = RedisSide(args.redis_url, engine)
    asker = Asker(index, CacheSpec(mode="semantic", vector_search=engine), queries)  # type: ignore[arg-type]
    table = []
    try:
        rows = np.concatenate([cached, filler(cached, args.size - len(cached))])
        await load(store, index, rows, asker.spec)
        await warmed(index, queries[0], asker.spec)
        for repeat in range(args.repeats):
            for n, mode in enumerate(args.modes.split(",")):
                before, began = side.read(), time.perf_counter()
                quiet = side.phase(before, await asker.rounds(2), time.perf_counter() - began)
                new = filler(cached, args.burst, seed=11 + 10 * repeat + n)
                tenant = f"burst{repeat}-{n}"
                during, took, timing = await _during(mode, store, asker, side, new, tenant, args)
                storing = [ms for at_s, ms in took if at_s < timing["stored_s"]]
                writing = [ms for at_s, ms in took if at_s >= timing["stored_s"]]
                table.append({
                    "engine": engine, "mode": mode, "repeat": repeat, "size": args.size,
                    "burst": args.burst, "rate": args.rate, **timing, "quiet": quiet.summary(),
                    "during": during.summary(), "storing": latencies(storing),
                    "writing": latencies(writing),
                })  # fmt: skip
                print(json.dumps(table[-1]), file=sys.stderr, flush=True)
    finally:
        side.close()
        await index.aclose()
        await store.aclose()
    return table


async def _during(
    mode: str, store: RedisCacheStore, asker: Asker, side: RedisSide, rows: np.ndarray,
    tenant: str, args: argparse.Namespace,
) -> tuple[Phase, list[tuple[float, float]], dict[str, float]]:  # fmt: skip
    """Lookups while the burst is stored in `mode` (all, and each one's time from the start);
    how long storing and writing took."""
    if mode.startswith("process"):
        url = args.apart_url if mode == "process-apart" else args.redis_url
        return await _during_child(asker, side, rows, tenant, url, args)
    graph = await asker.index.graph(asker.spec) if mode == "loop" else None
    before, began = side.read(), time.perf_counter()
    writing = asyncio.ensure_future(stored(store, rows, graph, tenant, args.rate))
    took = await asker.until(writing)
    timing = await writing
    wall_s = time.perf_counter() - began
    return side.phase(before, [ms for _, ms in took], wall_s), took, timing


async def _during_child(
    asker: Asker,
    side: RedisSide,
    rows: np.ndarray,
    tenant: str,
    url: str,
    args: argparse.Namespace,
) -> tuple[Phase, list[tuple[float, float]], dict[str, float]]:
    with tempfile.TemporaryDirectory() as folder:
        saved = Path(folder) / "burst.npy"
        np.save(saved, rows)
        child = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--redis-url", url, "--child", str(saved),
            "--engines", asker.spec.vector_search, "--tenant", tenant, "--rate", str(args.rate),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert child.stdin is not None
        assert child.stdout is not None
        if (await child.stdout.readline()).strip() != b"ready":
            raise SystemExit("the burst's process did not start")
        before, began = side.read(), time.perf_counter()
        child.stdin.write(b"go\n")
        await child.stdin.drain()
        answer = asyncio.ensure_future(child.stdout.readline())
        took = await asker.until(answer)
        timing = json.loads(await answer)
        wall_s = time.perf_counter() - began
        await child.wait()
    return side.phase(before, [ms for _, ms in took], wall_s), took, timing


async def stored(
    store: RedisCacheStore, rows: np.ndarray, graph: Graph | None, tenant: str, rate: float
) -> dict[str, float]:
    """The burst: every entry stored (the entry script), its vector queued (with a `graph`),
    then all written; seconds until the last entry was stored and until every vector was.
    `rate` entries a second at most (0: as fast as they go)."""
    began = time.perf_counter()
    for n, row in enumerate(rows):
        if rate and (ahead := began + n / rate - time.perf_counter()) > 0:
            await asyncio.sleep(ahead)
        partition, vector = (PARTITION, pack(row, "q")) if graph else (None, None)
        entry = CacheEntry(tenant, f"b{n}", b"", time.time(), 86_400.0, 10**7, partition,
                           vector, graph)  # fmt: skip
        await store.put(entry)
    stored_s = time.perf_counter() - began
    await store.flush_vectors()
    return {"stored_s": stored_s, "written_s": time.perf_counter() - began}


async def child(redis_url: str, engine: str, saved: Path, tenant: str, rate: float) -> None:
    """The burst in a process of its own: "ready", then on "go" the burst, then its timing."""
    rows = np.load(saved)
    store = RedisCacheStore(redis_url)
    index = SemanticIndex(store)
    try:
        graph = await index.graph(CacheSpec(mode="semantic", vector_search=engine))  # type: ignore[arg-type]
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        print(json.dumps(await stored(store, rows, graph, tenant, rate)), flush=True)
    finally:
        await index.aclose()
        await store.aclose()


def medians(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per engine and mode: each figure the median over the repeats, and the range of
    the quiet windows' p50 (how much the machine alone moved it)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in table:
        groups.setdefault((row["engine"], row["mode"]), []).append(row)
    out = []
    for (engine, mode), rows in groups.items():
        merged: dict[str, Any] = {"engine": engine, "mode": mode, "repeats": len(rows)}
        for key in ("stored_s", "written_s"):
            merged[key] = round(statistics.median(r[key] for r in rows), 1)
        for phase in ("quiet", "during", "storing", "writing"):
            measured = [r[phase] for r in rows if r[phase]["lookups"] >= 20] or [rows[0][phase]]
            merged[phase] = {
                stat: round(statistics.median(m[stat] for m in measured), 3) for stat in measured[0]
            }
        quiet_p50 = [r["quiet"]["p50_ms"] for r in rows]
        merged["quiet_p50_range"] = f"{min(quiet_p50)}-{max(quiet_p50)}"
        out.append(merged)
    return out


def _ms(phase: dict[str, float]) -> str:
    if phase["lookups"] < 20:
        return "-"
    return f"{phase['p50_ms']} / {phase['p95_ms']} / {phase['p99_ms']}"


def markdown(table: list[dict[str, Any]], load_avg: str) -> str:
    rate = table[0].get("rate") if table else None
    pace = f"at most {rate:g} entries a second" if rate else "as fast as they go"
    lines = [
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average {load_avg}; "
        f"bursts of {table[0]['burst'] if table else 0} entries, {pace}; medians of the repeats.",
        "",
        "| engine | burst from | entries stored in s | vectors written in s "
        "| quiet p50 / p95 / p99 ms | quiet p50 range ms | while storing p50 / p95 / p99 ms "
        "| then while writing vectors p50 / p95 / p99 ms | max ms quiet / during "
        "| Redis main thread busy quiet / during | lookup µs in Redis quiet / during |",
        "|---|---|---:|---:|---|---|---|---|---|---|---|",
    ]
    for row in medians(table):
        q, d = row["quiet"], row["during"]
        lines.append(
            f"| {row['engine']} | {row['mode']} | {row['stored_s']} | {row['written_s']} "
            f"| {_ms(q)} | {row['quiet_p50_range']} | {_ms(row['storing'])} "
            f"| {_ms(row['writing'])} | {q['max_ms']} / {d['max_ms']} "
            f"| {q['redis_main_busy']:.0%} / {d['redis_main_busy']:.0%} "
            f"| {q['lookup_usec']:.0f} / {d['lookup_usec']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--data", type=Path, default=DATA / "qqp_dev.jsonl")
    parser.add_argument("--size", type=int, default=10_000)
    parser.add_argument("--burst", type=int, default=5_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", default="redis-search,redis-vsets")
    parser.add_argument("--modes", default="loop,process", help=f"any of {', '.join(MODES)}")
    parser.add_argument(
        "--rate", type=float, default=0.0,
        help="entries the burst stores a second at most (0: as fast as it can)",
    )  # fmt: skip
    parser.add_argument("--apart-url", help="another Redis 8, for --modes process-apart")
    parser.add_argument("--out", default="semantic_burst", help="results file name, no suffix")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tenant", default="burst", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if "process-apart" in args.modes and not args.apart_url:
        parser.error("--modes process-apart needs --apart-url")
    if args.child:
        asyncio.run(child(args.redis_url, args.engines, args.child, args.tenant, args.rate))
        return 0
    cached, queries, _ = engine_inputs(qqp_rows(args.data))
    load_avg = " ".join(f"{x:.2f}" for x in os.getloadavg())
    table = [
        row
        for engine in args.engines.split(",")
        for row in asyncio.run(burst_rows(engine, cached, queries, args))
    ]
    load_avg += " at the start, " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + " at the end"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(table, indent=2) + "\n")
    (RESULTS / f"{args.out}.md").write_text(markdown(table, load_avg), encoding="utf-8")
    print(markdown(table, load_avg))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
