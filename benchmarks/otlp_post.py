"""CPU per OTLP span post, for this tree and optionally another.

    python benchmarks/otlp_post.py [--base DIR] [--sizes 1000,115000] [--posts 200]
                                   [--rounds 5] [--busy] [--out NAME]

Posts `--posts` bodies of each size (115,000 bytes is a batch of 512 spans of the all-on
gateway) through the tree's `OtlpPoster` to a stand-in collector in this process
(benchmarks/otelsink.py), one post every 20 ms as the span thread posts under load, and reads
the posting thread's CPU time around each post. Each tree runs in a fresh interpreter with the
tree as its cwd, the rounds alternating; medians over the rounds. `--busy` runs a pure-Python
loop in another thread meanwhile, as the gateway's event loop runs beside the span thread:
every time the poster lets go of the GIL (each socket call) it must take it back from that
thread. Results: benchmarks/results/NAME.{json,md} (NAME is otlp-post unless given).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from typing import Any

from otelsink import otlp_sink
from twotrees import add_tree_arguments, alternating, run_facts, run_in, spin
from twotrees import trees as trees_of


def measure(url: str, size: int, posts: int, busy: bool = False) -> float:
    """CPU µs per post of `size` bytes to `url` (this process's tree)."""
    from proxy.telemetry.otlppost import OtlpPoster

    done = threading.Event()
    if busy:
        threading.Thread(target=spin, args=(done,), daemon=True).start()
    poster = OtlpPoster({"OTEL_EXPORTER_OTLP_ENDPOINT": url})
    body = os.urandom(size)
    spent = 0.0
    for n in range(posts + 5):  # the first five open the connection and warm up
        started = time.thread_time()
        if not poster.send(body, 512):
            raise RuntimeError(f"the collector at {url} did not take a post")
        if n >= 5:
            spent += time.thread_time() - started
        time.sleep(0.02)
    done.set()
    poster.close()
    return spent / posts * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,115000")
    parser.add_argument("--posts", type=int, default=200)
    add_tree_arguments(parser, "otlp-post")
    args = parser.parse_args()
    trees = trees_of(args)
    sizes = [int(s) for s in args.sizes.split(",")]
    runs: dict[str, dict[int, list[float]]] = {name: {s: [] for s in sizes} for name in trees}
    with otlp_sink() as (url, _):
        for names in alternating(trees, args.rounds):
            for size in sizes:
                for name in names:
                    call = f"otlp_post.measure({url!r}, {size}, {args.posts}, {args.busy})"
                    runs[name][size].append(float(run_in(trees[name], "otlp_post", call)[-1]))
    medians = {
        name: {size: statistics.median(found) for size, found in by.items()}
        for name, by in runs.items()
    }
    report: dict[str, Any] = {
        **run_facts(), "rounds": args.rounds, "posts": args.posts, "busy": args.busy,
        "median_cpu_us_per_post": medians, "runs": runs,
    }  # fmt: skip
    lines = [
        f"Run {report['when']} on {report['machine']}; load average {report['load_before']}; "
        f"{args.posts} posts a run, medians of {args.rounds} rounds"
        f"{'; a busy Python thread beside the poster' if args.busy else ''}.",
        "",
        "| body bytes | " + " | ".join(f"{name} CPU µs/post" for name in trees) + " |",
        "|---:|" + "---:|" * len(trees),
    ]
    for size in sizes:
        cells = [f"{medians[name][size]:.0f}" for name in trees]
        lines.append(f"| {size:,} | " + " | ".join(cells) + " |")
    from harness import publish  # here: a measured child imports this module, not the package

    publish(args.out, report, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
