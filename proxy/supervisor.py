"""The supervisor of `tokenweir serve --workers N`: uvicorn's, except that SIGHUP (and, with
`--watch`, a change of the policy file) reloads the workers' policy one worker at a time
(proxy/rollout.py) instead of restarting them, and that a worker busy building a tokenizer is not
taken for stuck."""

from __future__ import annotations

import logging
import socket
import time

import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors import Multiprocess
from uvicorn.supervisors.multiprocess import Process

from proxy.filewatch import FileWatch
from proxy.rollout import Rollout
from proxy.sighup import hold_sighup, release_sighup, sighup_held

__all__ = ["ReloadingWorkers"]

_log = logging.getLogger("uvicorn.error")  # the supervisor's own log, as uvicorn's lines
_SILENT_LIMIT_S = 120.0  # a live worker's health pings unanswered this long: it is stuck
_WATCH_INTERVAL_S = 1.0  # as a single process's watcher polls


class ReloadingWorkers(Multiprocess):
    """uvicorn's worker supervisor, except that SIGHUP reloads the workers' policy one at a
    time (each worker reloads on SIGHUP) instead of restarting them, which would cut their
    streams. Each worker starts with SIGHUP held, until its reloader takes it."""

    def __init__(
        self,
        config: uvicorn.Config,
        sockets: list[socket.socket],
        rollout: Rollout,
        watch: FileWatch | None,
    ) -> None:
        """`watch`: the policy file, watched here (not by each worker, which would all reload
        at once) under `--watch`."""
        super().__init__(config, sockets)
        self._silent: dict[int | None, float] = {}  # by pid: when its pings began to go unanswered
        self._rollout = rollout
        self._watch = watch
        self._watched_at = time.monotonic()

    def init_processes(self) -> None:
        super().init_processes()  # SIGHUP held since `_serve` began
        release_sighup()  # the supervisor's handler (queued, then handled) takes it from now on

    def terminate_all(self) -> None:
        # Stopping: SIGHUP is no longer answered (nor forwarded), and once Python exits its
        # default action (ending the process) is back: one sent then made a clean stop look
        # killed (status 129). Held, it is ignored, as it is by a worker that stops.
        hold_sighup()
        super().terminate_all()

    def keep_subprocess_alive(self) -> None:
        """uvicorn's, except for a live worker that does not answer a health ping: its answer
        comes from a thread, which needs the GIL, and building a large HF tokenizer holds the GIL
        for seconds (at startup, on a reload). It is taken for stuck only once silent for
        _SILENT_LIMIT_S; uvicorn killed it (SIGKILL) after 5 s, cutting its streams. Then the
        reload under way moves on (this runs twice a second)."""
        if self.should_exit.is_set():
            return
        with sighup_held():  # it may start a worker
            for index, process in enumerate(self.processes):
                if self._alive(process):
                    continue
                process.kill()
                process.join()
                if process.exitcode == STARTUP_FAILURE:  # broken: every restart would fail too
                    _log.error(
                        "Child process [%s] failed to start, stopping the parent process.",
                        process.pid,
                    )
                    self.should_exit.set()
                    return
                if self.should_exit.is_set():  # stopping meanwhile: none is started again
                    return
                _log.info("Child process [%s] died", process.pid)
                self.processes[index] = started = Process(self.config, self.sockets)
                started.start()
        self._watch_file()
        self._rollout.step(self._running())

    def _alive(self, process: Process) -> bool:
        if not process.process.is_alive():
            self._silent.pop(process.pid, None)
            return False
        if process.ping():  # at most 5 s
            self._silent.pop(process.pid, None)
            return True
        since = self._silent.setdefault(process.pid, time.monotonic())
        if time.monotonic() - since < _SILENT_LIMIT_S:
            return True
        _log.error(
            "Child process [%s] silent for %.0f s, taken for stuck", process.pid, _SILENT_LIMIT_S
        )
        return False

    def _running(self) -> set[int]:
        """The workers' pids, of those still running."""
        return {p.pid for p in self.processes if p.pid is not None and p.process.is_alive()}

    def _watch_file(self) -> None:
        if self._watch is None or time.monotonic() - self._watched_at < _WATCH_INTERVAL_S:
            return
        self._watched_at = time.monotonic()
        if self._watch.changed():
            _log.info("The policy file changed, reloading it in every worker, one at a time.")
            self._reload_all()

    def handle_ttin(self) -> None:
        with sighup_held():
            super().handle_ttin()

    def exit_status(self) -> int:
        """A worker that failed to start (uvicorn then stops them all) fails the command too,
        as one process does: a service manager must not take the stop for a clean exit."""
        failed = any(process.exitcode == STARTUP_FAILURE for process in self.processes)
        return STARTUP_FAILURE if failed else 0

    def handle_hup(self) -> None:
        _log.info("Received SIGHUP, reloading the policy in every worker, one at a time.")
        self._reload_all()

    def _reload_all(self) -> None:
        running = self._running()
        self._rollout.begin(running)
        self._rollout.step(running)  # the first worker now, not at the next tick
