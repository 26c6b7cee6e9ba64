"""Writes that the workers of one `serve --workers N` make in turn: they share one stdout, and a
pipe or socket cuts a write longer than PIPE_BUF wherever the reader falls behind, letting the
other worker's bytes into the middle of a line. A lock file in the server's private directory
(TOKENWEIR_METRICS_DIR) keeps each batch whole."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from proxy.telemetry.workershare import METRICS_DIR_ENV

__all__ = ["in_turn", "shared_lock"]


def shared_lock(name: str) -> Path | None:
    """The lock file `name` the workers share, or None in a single process (nothing to share)."""
    directory = os.environ.get(METRICS_DIR_ENV)
    return Path(directory) / name if directory else None


@contextmanager
def in_turn(lock: Path | None) -> Iterator[None]:
    """Hold `lock` while the body runs; at once without one, or without its directory (the
    server is stopping: no other worker writes). A new open each time: a forked child shares
    its parent's open file, and with it the lock."""
    if lock is None:
        yield
        return
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # and the lock with it
