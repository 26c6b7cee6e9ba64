"""A worker of `tokenweir serve --workers N` drains and exits when its supervisor dies, instead
of serving on as an orphan that holds the port and that nobody restarts, reloads or stops."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

__all__ = ["end_with_supervisor"]

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
