"""Standard streams the shell closed (`2>&-`, `>&-`, `<&-`) made /dev/null before anything else.

A closed fd 0-2 is the lowest free number, so the next socket, pipe or file takes it: libuv
(uvloop) aborted the process closing it (it asserts it never closes fds 0-2), and Python, its
`sys.stderr` None, printed a command's errors on stdout (`print(file=None)` is stdout).
"""

from __future__ import annotations

import os
import sys
from typing import TextIO

__all__ = ["fill_closed_stdio"]


def fill_closed_stdio() -> None:
    """Open /dev/null on each of fds 0-2 that is closed, and give Python a stream on it where
    it had none (it sets `sys.stdin`, `sys.stdout`, `sys.stderr` to None for a closed fd)."""
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            null = _null(fd)  # the lowest free number: fd itself, the ones below it open
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            closed = True
        else:
            closed = False
        if getattr(sys, name) is None:
            # An fd open now though Python found it closed at its start belongs to whoever
            # opened it since: the stream writes to a /dev/null of its own instead.
            target = fd if closed else _null(fd)
            setattr(sys, name, _stream(target, fd, own=not closed))


def _null(fd: int) -> int:
    return os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)


def _stream(target: int, fd: int, *, own: bool) -> TextIO:
    if fd == 0:
        return open(target, closefd=own)
    # Python's own settings for stdout and stderr: whole lines, and nothing it cannot encode
    # ends the command (the text goes nowhere).
    return open(target, "w", buffering=1, errors="backslashreplace", closefd=own)
