"""A worker of `tokenweir serve --workers N` drains and exits when its supervisor dies, instead
of serving on as an orphan that holds the port and that nobody restarts, reloads or stops; the
last such worker out removes the workers' metrics directory, which the supervisor would have."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from pathlib import Path

from proxy.telemetry.workershare import METRICS_DIR_ENV, leave_orphaned

__all__ = ["end_with_supervisor", "leave_if_orphaned"]

_log = logging.getLogger("tokenweir")
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def end_with_supervisor(supervisor_pid: int) -> bool:
    """Have the kernel send this worker SIGTERM (the drain) when `supervisor_pid`, its parent,
    dies, SIGKILL included; one already gone gets the SIGTERM now. False where that cannot be
    arranged (not Linux): the worker then outlives a supervisor killed with SIGKILL."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return False
    # Checked after the call: a supervisor that died before it sends no signal any more.
    if os.getppid() != supervisor_pid:
        _log.warning("the supervisor [%d] is gone: this worker drains and exits", supervisor_pid)
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def leave_if_orphaned(supervisor_pid: int) -> None:
    """At a worker's stop (the app's shutdown, after its last figures are written): its
    supervisor gone, nobody else removes the metrics directory; the last worker out does."""
    directory = os.environ.get(METRICS_DIR_ENV)
    if directory and os.getppid() != supervisor_pid:
        leave_orphaned(Path(directory))
