"""Redis's CPU for the stores' sorted sets, their scores fractional or whole seconds.

    python benchmarks/redis_scores.py [--rounds 3] [--calls 3000]

The stores' leases (a quota reservation's, a concurrency slot's) and the cache's LRU are sorted
sets scored by a time. Redis keeps a set of up to 128 members as a listpack, which stores an
integral score as an integer and any other as text, parsed again (strtod) for every member an
insert or a range passes; a larger set is a skiplist of doubles. proxy/storage/redis/quota.py,
limits.py and cache.py send whole seconds for that reason. This replays the stores' own
operations (the link's one script, its MessagePack arguments) against a private redis-server,
pipelined 32 at a time, the two score kinds alternating by round, and reads Redis's CPU
(`INFO cpu`, user and system) around each:

    leases     a request's admission (quota reservation, buckets, slot, cache lookup) and its
               settlement, 64 leases held at a time (as at 64 in flight)
    hits 100   a cache hit's LRU update in a tenant's set of 100 answers (a listpack)
    hits 1000  the same in a set of 1,000 (a skiplist: the control)

Reports medians of the rounds, in µs of Redis CPU a call (a request for `leases`).
Results: benchmarks/results/redis-scores.{json,md}.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import redis
from harness import cell, publish, table
from storage_calls import redis_cpu_s

from proxy.storage.redis.link import ops_script, packed
from tests.redis_server import private_redis

START = 1_796_482_224.7230515  # a wall time with the 17 digits a float's text has
LEASE_S = 60.0
IN_FLIGHT = 64
TENANT = "tw:{bench}"
COUNTERS = [f"{TENANT}:q:tokens:d:20261205", f"{TENANT}:q:usd:d:20261205"]
Score = Callable[[float], float]
Sender = Callable[[Any, str, int, Score], None]


def admission_and_settlement(pipe: Any, sha: str, i: int, score: Score) -> None:
    now = START + i * 0.0005
    until = score(now + LEASE_S)
    keys = [f"{TENANT}:leases", f"{TENANT}:lease_holdings", *COUNTERS, f"{TENANT}:rl:rpm",
            f"{TENANT}:rl:tpm", f"{TENANT}:rl:slots", f"{TENANT}:cache:x:{i}",
            f"{TENANT}:cache:lru"]  # fmt: skip
    operations = [
        "reserve", 4, 9, f"q{i}", until, now, 10**11, 97, 1796601600, 10**16, 14500, 1796601600,
        "admit", 3, 11, now, f"s{i}", until, 2, 10**8, 1666666.6666666667, 1, 10**10,
        166666666.66666666, 97, 10**5,
        "cache_get", 2, 2, score(now), str(i),
    ]  # fmt: skip
    pipe.evalsha(sha, len(keys), *keys, "gate", 3, packed(operations))
    if i >= IN_FLIGHT:
        j = i - IN_FLIGHT
        keys = [f"{TENANT}:rl:slots", f"{TENANT}:leases", f"{TENANT}:lease_holdings", *COUNTERS]
        operations = ["limits_release", 1, 1, f"s{j}", "settle", 4, 5, f"q{j}", 93, 1796601600,
                      14100, 1796601600]  # fmt: skip
        pipe.evalsha(sha, len(keys), *keys, "each", 2, packed(operations))


def cache_hits(entries: int) -> Sender:
    def hit(pipe: Any, sha: str, i: int, score: Score) -> None:
        prefix = f"{TENANT}:cache:"
        member = str(i % entries)
        now = score(START + entries + i * 0.001)
        operations = ["cache_get", 2, 2, now, member]
        pipe.evalsha(sha, 2, f"{prefix}x:{member}", f"{prefix}lru", "gate", 1, packed(operations))

    return hit


def fill_cache(client: redis.Redis, sha: str, entries: int, score: Score) -> None:
    prefix = f"{TENANT}:cache:"
    pipe = client.pipeline(transaction=False)
    for i in range(entries):
        now = score(START + i * 0.37)
        keys = [f"{prefix}x:{i}", f"{prefix}lru", f"{prefix}vec", f"{prefix}v:-"]
        operations = ["cache_put", 4, 11, str(i), b"an answer" * 20, 3_600_000, now,
                      now - 3600, 10_000, prefix, "", b"", 7_200_000, ""]  # fmt: skip
        pipe.evalsha(sha, 4, *keys, "each", 1, packed(operations))
    pipe.execute()


def one_run(client: redis.Redis, sha: str, case: str, whole: bool, calls: int) -> float:
    """Redis CPU µs a call of `case`, scores whole seconds or not."""
    score: Score = math.ceil if whole else float
    client.flushall()
    send: Sender = admission_and_settlement
    if case != "leases":
        entries = int(case.split()[1])
        fill_cache(client, sha, entries, score)
        send = cache_hits(entries)
    pipe = client.pipeline(transaction=False)
    before = redis_cpu_s(client)
    for i in range(calls):
        send(pipe, sha, i, score)
        if i % 32 == 31:
            pipe.execute()
    pipe.execute()
    return (redis_cpu_s(client) - before) / calls * 1e6


CASES = ("leases", "hits 100", "hits 1000")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    runs: dict[str, dict[str, list[float]]] = {c: {"fraction": [], "whole": []} for c in CASES}
    with private_redis() as url:
        client = redis.Redis.from_url(url)
        sha = client.script_load(ops_script())
        version = client.info("server")["redis_version"]
        for index in range(args.rounds):
            kinds = ("fraction", "whole") if index % 2 == 0 else ("whole", "fraction")
            for case in CASES:
                for kind in kinds:
                    runs[case][kind].append(one_run(client, sha, case, kind == "whole", args.calls))
        client.close()
    report: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}",
        "redis": version, "rounds": args.rounds, "calls": args.calls, "runs": runs,
    }  # fmt: skip
    publish("redis-scores", report, markdown(report))
    return 0


def markdown(report: dict[str, Any]) -> str:
    rows = []
    for case, kinds in report["runs"].items():
        fraction, whole = (statistics.median(kinds[k]) for k in ("fraction", "whole"))
        rows.append([case, cell(fraction, 1), cell(whole, 1), cell(whole / fraction, 2)])
    columns = (("case", None, 0), ("fractional scores", None, 0), ("whole seconds", None, 0),
               ("ratio", None, 0))  # fmt: skip
    lines = [
        f"Run {report['when']} on {report['machine']}; redis-server {report['redis']}; "
        f"{report['calls']:,} calls a run, medians of {report['rounds']} rounds; Redis CPU µs "
        "a call (`leases`: an admission and its settlement).",
        "",
        *table(columns, rows),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
