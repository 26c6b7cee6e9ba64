"""The `tokenweir` command's entry point (and `python -m proxy`'s): `serve` holds SIGHUP before
the command line's imports, which take most of a second (proxy/sighup.py says why)."""

from __future__ import annotations

import sys

from proxy.sighup import hold_sighup

__all__ = ["main"]


def main() -> int:
    if sys.argv[1:2] == ["serve"]:
        hold_sighup()
    from proxy.cli import main as run  # imported here, after the hold: it is the slow part

    return run()
