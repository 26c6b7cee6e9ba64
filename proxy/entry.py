"""The `tokenweir` command's entry point (and `python -m proxy`'s): `serve` holds SIGHUP before
the command line's imports, which take most of a second (proxy/sighup.py says why); Ctrl-C and a
reader that went away end any command with a status (proxy/exitstatus.py), not a traceback; a
standard stream the shell closed is /dev/null (proxy/nullstdio.py)."""

from __future__ import annotations

import contextlib
import os
import sys

from proxy.exitstatus import INTERRUPTED, READER_GONE
from proxy.nullstdio import fill_closed_stdio
from proxy.sighup import hold_sighup

__all__ = ["main"]


def main() -> int:
    fill_closed_stdio()  # first: before any fd is opened, to be given a closed one's number
    if sys.argv[1:2] == ["serve"]:
        hold_sighup()
    try:
        from proxy.cli import main as run  # imported here, after the hold: it is the slow part

        try:
            return run()  # argparse's --help, --version and usage errors raise SystemExit
        finally:
            sys.stdout.flush()  # here, for a closed pipe to be seen below rather than at exit
    except KeyboardInterrupt:
        with contextlib.suppress(OSError):
            print(file=sys.stderr)  # the shell's prompt on a line of its own, after the ^C
        return INTERRUPTED
    except BrokenPipeError:
        # Python's exit would flush what is left into the closed pipe, and print that it could
        # not: what is left goes nowhere instead.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.dup2(devnull, sys.stderr.fileno())
        return READER_GONE
