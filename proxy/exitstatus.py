"""The `tokenweir` command's exit statuses beyond 0 (done) and 1 (failed): one meaning each,
whichever command ends with it (README, "Exit status")."""

from __future__ import annotations

__all__ = ["CANNOT_SERVE", "INTERRUPTED", "READER_GONE", "TERMINATED", "USAGE"]

USAGE = 2
"""Flags or arguments that cannot be used (argparse's own status for them)."""
CANNOT_SERVE = 3
"""A server that could not start serving: its port in use, say (uvicorn's own status for it)."""
INTERRUPTED = 130
"""Ctrl-C before the command's work was done (128 + SIGINT, as a shell reports it)."""
TERMINATED = 143
"""SIGTERM before the work was done, where the command ends on it cleanly (`bench`)."""
READER_GONE = 141
"""Its output's reader closed the pipe (`tokenweir report | head -1`): 128 + SIGPIPE, as `cat`."""
