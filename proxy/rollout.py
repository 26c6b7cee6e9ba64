"""Under `tokenweir serve --workers N`: a policy reload rolled through the workers one at a time,
so that the others serve while one builds what the new policy needs (a large HF tokenizer holds
its worker's GIL for seconds). The supervisor sends one worker SIGHUP and moves on once that
worker's published figures show the reload done: the file's version served, or a reload counted
(a refused or failed one too), or the worker gone."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from proxy.filewatch import read_version
from proxy.telemetry.metricstate import reloads_in, versions_in
from proxy.telemetry.workershare import published_by

__all__ = ["WORKER_RELOAD_LIMIT_S", "Rollout"]

WORKER_RELOAD_LIMIT_S = 120.0
"""How long one worker may take to show its reload done before the next is sent SIGHUP anyway
(a worker silent this long is taken for stuck by the supervisor too)."""
_log = logging.getLogger("uvicorn.error")  # the supervisor's own log, as uvicorn's lines


@dataclass(slots=True)
class _Reloading:
    pid: int
    version: str  # the file's, when the worker was sent SIGHUP
    reloads: int  # the reloads it had counted then
    since: float  # monotonic


class Rollout:
    """The workers still to reload, and the one reloading now; `step` moves it along."""

    def __init__(
        self,
        config: Path,
        metrics_dir: Path,
        clock: Callable[[], float] = time.monotonic,
        send: Callable[[int], None] = lambda pid: os.kill(pid, signal.SIGHUP),
    ) -> None:
        """`send` tells one worker to reload (SIGHUP; ProcessLookupError if it is gone)."""
        self._config = config
        self._metrics_dir = metrics_dir
        self._clock = clock
        self._send = send
        self._waiting: list[int] = []
        self._asked: set[int] | None = None  # the workers this rollout covers; None: none on
        self._now: _Reloading | None = None

    def begin(self, pids: Collection[int]) -> None:
        """Reload every one of `pids` (again, if a rollout is under way: the file changed)."""
        self._waiting = [pid for pid in pids if self._now is None or pid != self._now.pid]
        if self._now is not None:
            self._waiting.append(self._now.pid)  # last: it may have read the file before
        self._asked = set(pids)

    def step(self, running: Collection[int]) -> None:
        """Called on each supervisor tick with the workers running: send the next one SIGHUP
        once the one reloading is done. A worker already serving the file's version is passed
        over; one started in place of a dead one while the rollout went on is reloaded too (it
        may have started from the policy the others served before)."""
        if self._now is not None and not self._done(self._now, running):
            return
        self._now = None
        if self._asked is None:
            return
        self._waiting += [pid for pid in running if pid not in self._asked]
        self._asked |= set(running)
        version = self._version()
        while self._waiting:
            pid = self._waiting.pop(0)
            if pid not in running:
                continue
            published = published_by(self._metrics_dir, pid)
            if published is not None and versions_in(published) == {version}:
                continue
            try:
                self._send(pid)
            except ProcessLookupError:
                continue
            reloads = reloads_in(published) if published is not None else 0
            self._now = _Reloading(pid, version, reloads, self._clock())
            return
        self._asked = None  # every worker done

    def _done(self, reloading: _Reloading, running: Collection[int]) -> bool:
        if reloading.pid not in running:
            return True
        published = published_by(self._metrics_dir, reloading.pid)
        if published is not None and (
            versions_in(published) == {reloading.version}
            or reloads_in(published) > reloading.reloads
        ):
            return True
        if self._clock() - reloading.since < WORKER_RELOAD_LIMIT_S:
            return False
        _log.warning(
            "Child process [%s] has not shown its policy reload done after %.0f s; reloading the "
            "next one", reloading.pid, WORKER_RELOAD_LIMIT_S,
        )  # fmt: skip
        return True

    def _version(self) -> str:
        # "" for a file that cannot be read or is too large: the workers' reload refuses it,
        # and says why.
        return read_version(self._config) or ""
