"""How `tokenweir serve --workers N` shows the whole server on `/metrics`: the supervisor makes a
private directory (TOKENWEIR_METRICS_DIR) for the life of the server; each worker writes its
figures there as one JSON file, replaced atomically, at most every `PUBLISH_S` after a change,
when scraped and when it exits; the worker that answers a scrape sums its own live figures
with every other file.

A file is named `{pid}-{random}.json`, so a worker the supervisor restarts writes a new file
and the dead one's stays: its counts stay in the sum (counters never go backwards) and are
never counted twice. Only in-flight streams, a gauge, are left out for a worker no longer alive.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from proxy.atomicfile import replace_file

__all__ = ["METRICS_DIR_ENV", "PUBLISH_S", "WorkerShare"]

METRICS_DIR_ENV = "TOKENWEIR_METRICS_DIR"
PUBLISH_S = 0.1  # how stale another worker's figures may be on a scrape

_log = logging.getLogger("tokenweir.metrics")


class WorkerShare:
    """This worker's file in the server's metrics directory, and the other workers' files."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self.path = directory / f"{os.getpid()}-{secrets.token_hex(4)}.json"
        self._failed = False

    @classmethod
    def from_environment(cls) -> WorkerShare | None:
        """The share set up by the supervisor, or None in a single process."""
        directory = os.environ.get(METRICS_DIR_ENV)
        return cls(Path(directory)) if directory else None

    def publish(self, dumped: bytes) -> None:
        """Replace this worker's file (a small local write: no await, no partial file)."""
        try:
            replace_file(self.path, dumped)
        except OSError as exc:  # the directory went away: the server is stopping
            if not self._failed:
                _log.warning("cannot share this worker's metrics in %s: %s", self._directory, exc)
            self._failed = True

    def others(self) -> Iterator[tuple[bytes, bool]]:
        """Every other worker's last figures, and whether that worker is still alive."""
        for path in self._directory.glob("*.json"):
            if path == self.path:
                continue
            try:
                dumped = path.read_bytes()
            except OSError:  # replaced or removed meanwhile: its next version is read next time
                continue
            yield dumped, _alive(int(path.name.partition("-")[0]))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process took the number: not our worker
        return False
    return True
