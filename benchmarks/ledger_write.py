"""The SQLite ledger writer's CPU per record, by batch size, for this tree and optionally another.

    python benchmarks/ledger_write.py [--base DIR] [--batches 8,32,128] [--records 20000]
                                      [--rounds 5] [--busy] [--out NAME]

Writes `--records` records like the all-on benchmark's (one tenant, model, backend and key, no
user or tags, non-stream) through `sqlschema.write_batch` into a fresh database, `--batches`
records a transaction (the writer commits every 50 ms: about 32 a batch at 600 requests/s), and
reads the thread's CPU time. With `--base DIR` the same runs happen for the tree in DIR, each
tree in its own process, the rounds alternating; medians over the rounds. `--busy` runs a
pure-Python loop in another thread meanwhile, as the gateway's event loop runs beside the
writer under load, and writes a batch every 50 ms, as the writer does: every time the writer
lets go of the GIL (each SQLite statement's step) it must take it back from that thread,
waiting up to the switch interval (5 ms) each time: the wall time a batch takes then counts
those handoffs, and is reported beside the CPU. Results: benchmarks/results/NAME.{json,md}
(NAME is ledger-write unless given).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from twotrees import add_tree_arguments, alternating, run_facts, run_in, spin
from twotrees import trees as trees_of


def measure(batch: int, records: int, busy: bool = False) -> tuple[float, float]:
    """CPU µs per record and wall ms per batch for `records` written `batch` at a time (this
    process's tree), with a busy Python thread beside the writer if `busy`."""
    from proxy.ledger import sqlschema

    done = threading.Event()
    if busy:
        threading.Thread(target=spin, args=(done,), daemon=True).start()

    now = time.time()
    rows = [_record(now + n / 1000, f"req_{n:032x}") for n in range(records)]
    with tempfile.TemporaryDirectory() as tmp:
        conn = sqlschema.connect(Path(tmp) / "ledger.db", busy_timeout_s=5.0, writer=True)
        checkpoints: dict[str, int] = {}
        spent = waited = 0.0
        for i in range(0, records, batch):
            started, began = time.thread_time(), time.perf_counter()
            sqlschema.write_batch(conn, rows[i : i + batch], checkpoints)
            spent += time.thread_time() - started
            waited += time.perf_counter() - began
            if busy:
                time.sleep(0.05)  # the writer's interval (not counted)
        done.set()
        conn.close()
    return spent / records * 1e6, waited / -(-records // batch) * 1e3


def _record(ts: float, request_id: str) -> Any:
    """A record like the all-on benchmark's (imported here: the tree under test is the cwd's)."""
    from proxy.ledger.base import UsageRecord

    return UsageRecord(
        ts=ts, request_id=request_id, tenant="bench", model="mock-llm", backend="mock",
        operation="chat", stream=False, status=200, error=None, input_tokens=64,
        output_tokens=16, cost_nusd=12_800, cache="miss", ttft_ms=None, tokens_per_s=None,
        duration_ms=1.2, shaped=(), degraded=(), client_disconnected=False,
        key_id="sha256:b0962662e937", usage_source="backend",
    )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="8,32,128")
    parser.add_argument("--records", type=int, default=20_000)
    add_tree_arguments(parser, "ledger-write")
    args = parser.parse_args()
    trees = trees_of(args)
    batches = [int(b) for b in args.batches.split(",")]
    runs: dict[str, dict[int, list[tuple[float, float]]]] = {
        name: {b: [] for b in batches} for name in trees
    }
    for names in alternating(trees, args.rounds):
        for batch in batches:
            for name in names:
                call = f"*ledger_write.measure({batch}, {args.records}, {args.busy})"
                cpu, wall = map(float, run_in(trees[name], "ledger_write", call)[-2:])
                runs[name][batch].append((cpu, wall))
    report: dict[str, Any] = {
        **run_facts(),
        "rounds": args.rounds,
        "records": args.records,
        "busy": args.busy,
        "median_us_per_record": _medians(runs, 0),
        "median_wall_ms_per_batch": _medians(runs, 1),
    }
    lines = [
        f"Run {report['when']} on {report['machine']}; load average {report['load_before']}; "
        f"{args.records:,} records a run, medians of {args.rounds} rounds"
        f"{'; a busy Python thread beside the writer' if args.busy else ''}.",
        "",
        "| batch | "
        + " | ".join(f"{name} CPU µs/record | {name} wall ms/batch" for name in trees)
        + " |",
        "|---:|" + "---:|---:|" * len(trees),
    ]
    for batch in batches:
        cells = [
            f"{report['median_us_per_record'][name][batch]:.1f} | "
            f"{report['median_wall_ms_per_batch'][name][batch]:.2f}"
            for name in trees
        ]
        lines.append(f"| {batch} | " + " | ".join(cells) + " |")
    from harness import publish  # here: a measured child imports this module, not the package

    publish(args.out, report, "\n".join(lines) + "\n")
    return 0


def _medians(runs: dict[str, dict[int, list[tuple[float, float]]]], which: int) -> Any:
    return {
        name: {b: statistics.median(found[which] for found in runs_) for b, runs_ in by.items()}
        for name, by in runs.items()
    }


if __name__ == "__main__":
    sys.exit(main())
