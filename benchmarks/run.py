"""The whole benchmark suite, one command: run every benchmark, then write its tables into
docs/benchmarks.md (between `<!-- results: NAME -->` and `<!-- /results: NAME -->` markers).

    python benchmarks/run.py [--repeats 3]
        [--only overhead,overhead-all,overhead-telemetry,overhead-telemetry-sampled,budgets,
                ratelimits,dashboard,routing,redis-calls,workers-scale]

About 20 minutes on 2 cores. Each benchmark compares the same load direct and through tokenweir
(or without and with a feature) in one run; see docs/benchmarks.md for what each measures.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
DOC = HERE.parent / "docs" / "benchmarks.md"
SUITE: dict[str, list[str]] = {
    "overhead": ["overhead.py"],
    "overhead-all": ["overhead.py", "--features", "all"],
    "overhead-telemetry": ["overhead.py", "--features", "telemetry"],
    "overhead-telemetry-sampled": ["overhead.py", "--features", "telemetry-sampled"],
    "budgets": ["budgets.py"],
    "ratelimits": ["ratelimits.py"],
    "dashboard": ["dashboard.py"],
    "cache-speed": ["cache_speed.py"],
    "semantic_cache": ["semantic_cache.py"],
    "routing": ["routing.py"],
    "redis-calls": ["redis_calls.py"],
    "workers-scale": ["workers_scale.py"],  # needs wrk and nginx (Debian's packages)
}


def fill(doc: str, name: str, table: str) -> str:
    """`doc` with the block between `name`'s markers replaced by `table`."""
    pattern = re.compile(
        rf"(<!-- results: {re.escape(name)} -->\n).*?(<!-- /results: {re.escape(name)} -->)", re.S
    )
    if not pattern.search(doc):
        raise SystemExit(f"docs/benchmarks.md has no markers for {name!r}")
    return pattern.sub(lambda m: m.group(1) + table.rstrip() + "\n" + m.group(2), doc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default=",".join(SUITE))
    args = parser.parse_args()
    names = args.only.split(",")
    for name in names:
        print(f"== {name}", file=sys.stderr, flush=True)
        command = [sys.executable, str(HERE / SUITE[name][0]), *SUITE[name][1:]]
        subprocess.run([*command, "--repeats", str(args.repeats)], check=True)
    doc = DOC.read_text(encoding="utf-8")
    for name in names:
        doc = fill(doc, name, (HERE / "results" / f"{name}.md").read_text(encoding="utf-8"))
    DOC.write_text(doc, encoding="utf-8")
    print(f"updated {DOC}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
