"""How `tokenweir serve --workers N` shows the whole server on `/metrics`: the supervisor makes a
private directory (TOKENWEIR_METRICS_DIR) for the life of the server; each worker writes its
figures there as one JSON file, replaced atomically, at most every `PUBLISH_S` after a change,
when scraped and when it exits; the worker that answers a scrape sums its own live figures
with every other file.

A file is named `{pid}-{random}.json`, so a worker the supervisor restarts writes a new file.
A scrape folds a dead worker's file into one archive of every dead worker's counts (its gauges,
the in-flight streams, are left out: it holds none) and removes it: counters never go backwards,
nothing is counted twice, and the directory holds one file per live worker and the archive.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import orjson

from proxy.atomicfile import replace_file

__all__ = [
    "ARCHIVE",
    "METRICS_DIR_ENV",
    "PUBLISH_S",
    "Fold",
    "WorkerShare",
    "leave_orphaned",
    "published_by",
]

METRICS_DIR_ENV = "TOKENWEIR_METRICS_DIR"
PUBLISH_S = 0.1  # how stale another worker's figures may be on a scrape
ARCHIVE = "dead-workers.archive"  # not `*.json`: never taken for a worker's file
_LOCK = ".lock"
_LEFT = ".left"  # `{pid}.left`: an orphaned worker on its way out (see leave_orphaned)

Fold = Callable[[Sequence[bytes]], bytes]
"""Workers' figures summed into one JSON object (counters only: the dead hold no gauge); any
other key of theirs (the archive's own list of what it holds) is ignored."""

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

    def others(self, fold: Fold) -> list[tuple[bytes, bool]]:
        """Every other worker's last figures, and whether that worker is still alive: the dead
        ones' as one archive, into which the dead workers' files are first folded with `fold`
        (by one worker at a time; the others read meanwhile under a shared lock)."""
        try:
            with _locked(self._directory / _LOCK) as exclusive:
                if exclusive:
                    self._fold_dead(fold)
                return self._read_others()
        except OSError:  # the directory went away: the server is stopping
            return []

    def _read_others(self) -> list[tuple[bytes, bool]]:
        found = []
        for path in (*self._directory.glob("*.json"), self._directory / ARCHIVE):
            if path == self.path:
                continue
            try:
                dumped = path.read_bytes()
            except OSError:  # no archive yet, or a file removed: the server is stopping
                continue
            found.append((dumped, path.name != ARCHIVE and _alive(_pid(path.name))))
        return found

    def _fold_dead(self, fold: Fold) -> None:
        try:
            self._fold(fold)
        except OSError as exc:  # a full disk: the dead workers' files stay, and are read
            _log.warning("cannot fold dead workers' metrics in %s: %s", self._directory, exc)

    def _fold(self, fold: Fold) -> None:
        """Add the dead workers' files to the archive, then remove them. The archive names the
        files it holds, so a worker killed between the two steps leaves none counted twice."""
        archive = self._directory / ARCHIVE
        dead = [p for p in self._directory.glob("*.json") if not _alive(_pid(p.name))]
        for partial in self._directory.glob("*.partial"):  # a write a dead worker left half done
            if not _alive(_pid(partial.name.rsplit(".", 2)[-2])):
                partial.unlink(missing_ok=True)
        if not dead:
            return
        held = archive.read_bytes() if archive.exists() else None
        done = set(orjson.loads(held)["folded"]) if held is not None else set()
        new = [path.read_bytes() for path in dead if path.name not in done]
        if new:
            summed = orjson.loads(fold(new if held is None else [held, *new]))
            replace_file(archive, orjson.dumps({**summed, "folded": [p.name for p in dead]}))
        for path in dead:
            path.unlink()


def published_by(directory: Path, pid: int) -> bytes | None:
    """The figures the worker `pid` last published (its file), or None before its first."""
    for path in directory.glob(f"{pid}-*.json"):
        try:
            return path.read_bytes()
        except OSError:  # removed meanwhile: the worker is gone
            return None
    return None


def leave_orphaned(directory: Path) -> None:
    """An exiting worker whose supervisor died (and so never removes the directory): the last
    such worker out removes it. Each says it leaves, under the lock, before it looks: of two
    leaving at once, the second sees the first gone."""
    try:
        fd = os.open(directory / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:  # gone already
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        (directory / f"{os.getpid()}{_LEFT}").touch()
        staying = [
            pid
            for path in directory.glob("*.json")
            if (pid := _pid(path.name)) != os.getpid()
            and _alive(pid)
            and not (directory / f"{pid}{_LEFT}").exists()
        ]
        if not staying:
            shutil.rmtree(directory, ignore_errors=True)
    except OSError as exc:
        _log.warning("cannot remove the metrics directory %s: %s", directory, exc)
    finally:
        os.close(fd)


@contextmanager
def _locked(path: Path) -> Iterator[bool]:
    """The directory's lock, exclusive if no other worker holds it (True), else shared."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            yield True
        except BlockingIOError:
            fcntl.flock(fd, fcntl.LOCK_SH)  # another worker folds or reads: a few ms at most
            yield False
    finally:
        os.close(fd)  # and the lock with it


def _pid(name: str) -> int:
    digits = name.partition("-")[0]
    return int(digits) if digits.isdigit() else 0


def _alive(pid: int) -> bool:
    if pid <= 0:  # not a worker's name (os.kill(0) would mean our own process group)
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process took the number: not our worker
        return False
    return True
