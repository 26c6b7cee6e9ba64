"""For benchmarks that measure this checkout against another: each run in a fresh interpreter
whose working directory is the tree under test, so `import proxy` finds that tree's package.
Nothing here imports the package (harness.py does, from this checkout)."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


def add_tree_arguments(parser: argparse.ArgumentParser, out: str) -> None:
    """--base DIR, --rounds, --busy and --out (the results' name, `out` unless given)."""
    parser.add_argument("--base", type=Path, help="another checkout to measure alongside")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--busy", action="store_true", help="a busy Python thread beside it")
    parser.add_argument("--out", default=out, help="results file name, no suffix")


def trees(args: argparse.Namespace) -> dict[str, Path]:
    """This checkout, and the one `--base` names."""
    return {"this": HERE.parent} | ({"base": args.base.resolve()} if args.base else {})


def alternating(trees: dict[str, Path], rounds: int) -> Iterator[list[str]]:
    """The trees' names in each round's order: as given, then reversed, and so on."""
    names = list(trees)
    for round_ in range(rounds):
        yield names if round_ % 2 == 0 else names[::-1]


def run_facts() -> dict[str, Any]:
    """When and on what a run began: its report's first fields."""
    return {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}",
        "load_before": round(os.getloadavg()[0], 2),
    }


def run_in(tree: Path, module: str, call: str) -> list[str]:
    """What `print(call)` prints, as words, run in a fresh interpreter that imports `module`
    and the tree in `tree` (this folder's modules from here); a `call` of `*f()` prints the
    items of what f returns."""
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import {module}; print({call})"
    found = subprocess.run(
        [sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, check=True
    )
    return found.stdout.split()


def spin(done: threading.Event) -> None:
    """Run Python bytecode until `done`, as the gateway's event loop does beside a thread."""
    total = 0
    while not done.is_set():
        for n in range(1000):
            total += n
