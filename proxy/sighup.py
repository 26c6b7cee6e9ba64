"""SIGHUP held until the policy reloader takes it: its default action ends the process, and
`tokenweir serve` (and each worker it starts) spends about a second importing and starting
before the reloader's handler is in place. A SIGHUP sent meanwhile waits, then reloads."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

__all__ = ["hold_sighup", "release_sighup", "sighup_held"]


def hold_sighup() -> None:
    """Block SIGHUP in this thread and in every thread and process it starts from now on (a
    signal mask outlives fork and exec), until `release_sighup`."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})


def release_sighup() -> None:
    """Let this thread take SIGHUP again, once a handler is installed (one held is delivered)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})


@contextlib.contextmanager
def sighup_held() -> Iterator[None]:
    """SIGHUP held for a moment (while starting a worker, which inherits the held signal)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
