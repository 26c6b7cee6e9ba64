"""Policy reload: read the file again, refuse it if it is broken or needs a restart, else swap
the gateway's per-policy state at once (SIGHUP, `POST /admin/reload`, or the file changing).

Each request takes the gateway current at its start (`CurrentGateway`) and keeps it to its end.
With `--workers N`, SIGHUP to the supervisor reloads every worker, one at a time
(proxy/rollout.py), and a worker reloaded through the admin route sends SIGHUP to the
supervisor, so every worker reloads; the supervisor, not each worker, watches the file. Until the
reloader takes SIGHUP, `tokenweir serve` holds it (proxy/sighup.py): its default action would
end the process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, Self, TypeVar

from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.accepted import AcceptedPolicy
from proxy.errors import BadRequest
from proxy.filewatch import FileStamp, FileWatch, file_digest, read_version, stamp
from proxy.policy import Policy, PolicyError, decode_policy, parse_policy, read_policy_bytes
from proxy.sighup import hold_sighup, release_sighup
from proxy.together import cancelled

__all__ = [
    "SUPERVISOR_ENV",
    "WATCH_ENV",
    "CurrentGateway",
    "LiveGateway",
    "PolicySource",
    "ReloadRefused",
    "Reloaded",
    "Reloader",
    "policy_digest",
    "take_current",
]

WATCH_ENV = "TOKENWEIR_WATCH"
SUPERVISOR_ENV = "TOKENWEIR_SUPERVISOR_PID"
WATCH_INTERVAL_S = 1.0
# A reload applies the file once it held still this long (a writer's pauses are shorter), and
# refuses it if it is still changing after the limit.
SETTLE_S = 0.5
SETTLE_LIMIT_S = 10.0
# Sections resolved into long-lived objects (connections, the ledger, the server's sockets):
# a reload that changes one is refused rather than half applied.
RESTART_SECTIONS = ("storage", "ledger", "server", "upstream", "embedder")
_log = logging.getLogger("tokenweir.reload")


class ReloadRefused(BadRequest):
    """A policy file that was not loaded: the old policy keeps serving."""

    code = "invalid_policy"


@dataclass(frozen=True, slots=True)
class PolicySource:
    """A policy read from its file, with the digest of the file's bytes (its version)."""

    path: Path
    policy: Policy
    digest: str
    data: bytes
    # The file's `FileStamp` taken before its bytes were read: a later save changes it.
    # None when the bytes came from elsewhere (the accepted policy of `serve --workers N`).
    seen: FileStamp | None = None

    @classmethod
    def read(cls, path: Path) -> PolicySource:
        """Parse `path`; PolicyError names the file, line and key of every problem."""
        seen = stamp(path)
        return cls.parse(path, read_policy_bytes(path), seen)

    @classmethod
    def parse(cls, path: Path, data: bytes, seen: FileStamp | None = None) -> PolicySource:
        """`data` as the policy file `path` (problems are named by it)."""
        text = decode_policy(data, str(path))
        return cls(path, parse_policy(text, file=str(path)), file_digest(data), data, seen)

    @classmethod
    def starting(cls, path: Path, accepted: AcceptedPolicy | None) -> PolicySource:
        """The policy a process starts with: the file's, or under `serve --workers N` the one
        the workers serve (the file may hold a version they refused or have not reloaded)."""
        kept = accepted.read() if accepted is not None else None
        if kept is None:
            return cls.read(path)
        source = cls.parse(path, kept)
        if read_version(path) not in (None, source.digest):
            _log.warning(
                "%s is not the policy the other workers serve (%s); this worker serves "
                "theirs until a reload (SIGHUP) applies the file",
                path, source.digest,
            )  # fmt: skip
        return source


@dataclass(frozen=True, slots=True)
class Reloaded:
    previous_hash: str
    policy_hash: str
    changed: bool


def policy_digest(policy: Policy) -> str:
    """A version for a policy given as an object (tests): the digest of its JSON form."""
    return file_digest(policy.model_dump_json().encode())


async def _read_still(path: Path) -> PolicySource:
    """The file read once it held still for SETTLE_S across the read (a SIGHUP or an admin
    reload sent while it is being written must not apply a piece of it: a piece without a
    tenant revokes the tenant's runtime keys); ReloadRefused if it is broken, or still changing
    after SETTLE_LIMIT_S."""
    for _ in range(int(SETTLE_LIMIT_S / SETTLE_S)):
        before = stamp(path)
        await asyncio.sleep(SETTLE_S)
        try:  # off the loop: a file of many MB takes seconds to parse, streams go on
            source = await asyncio.to_thread(PolicySource.read, path)
        except PolicyError as exc:
            if stamp(path) != before:
                continue  # caught mid-write: read it again once it holds still
            raise ReloadRefused(
                f"The policy file has errors; the old policy keeps serving:\n{exc}"
            ) from exc
        if before == source.seen == stamp(path):
            return source
    raise ReloadRefused(
        f"{path} was still changing {SETTLE_LIMIT_S:.0f} s after the reload was asked for; the "
        "reload was refused and the old policy keeps serving."
    )


class Prober(Protocol):
    def start(self) -> None: ...

    async def aclose(self) -> None: ...


class Reloadable(Protocol):
    """What a reload needs of a gateway (proxy/gateway.py's `Gateway`)."""

    @property
    def policy(self) -> Policy: ...

    @property
    def policy_hash(self) -> str: ...

    @property
    def prober(self) -> Prober: ...

    async def reloaded(self, policy: Policy, policy_hash: str) -> Self: ...


G = TypeVar("G", bound=Reloadable)


class LiveGateway(Generic[G]):
    """The gateway that new requests get; `swap` replaces it."""

    def __init__(self) -> None:
        self._current: G | None = None

    @property
    def current(self) -> G:
        if self._current is None:
            raise RuntimeError("the gateway is not built yet")
        return self._current

    @current.setter
    def current(self, gateway: G) -> None:
        self._current = gateway

    async def swap(self, new: G) -> None:
        old, self._current = self._current, new
        if old is not None and old.prober is not new.prober:
            new.prober.start()
            await old.prober.aclose()


class CurrentGateway:
    """Pure ASGI middleware: each request's `scope["state"]["gateway"]` is the current one."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            take_current(scope)
        await self._app(scope, receive, send)


def take_current(scope: Scope) -> None:
    """An HTTP request's `scope["state"]["gateway"]` becomes the gateway current now."""
    state = scope.get("state")
    if state is not None and "live" in state:
        state["gateway"] = state["live"].current


def restart_needed(old: Policy, new: Policy) -> list[str]:
    """The sections `new` changes that only a restart applies."""
    return [name for name in RESTART_SECTIONS if getattr(old, name) != getattr(new, name)]


class Reloader(Generic[G]):
    """Loads the policy file again on request, on SIGHUP and (with `watch`) when it changes."""

    def __init__(
        self,
        live: LiveGateway[G],
        source: PolicySource | None,
        *,
        watch: bool,
        accepted: AcceptedPolicy | None = None,
        counted: Callable[[str], None] | None = None,
    ) -> None:
        """`accepted` keeps what each reload accepts, for workers started again later;
        `counted` is told each reload's result (the metrics)."""
        self._live = live
        self._accepted = accepted
        self._counted = counted
        self._path = source.path if source else None
        self._lock = asyncio.Lock()
        # As the file was when it was read, not now: a save since then (while the gateway
        # started, which may take long) is a change the watcher must see.
        self._watch = FileWatch(source.path, source.seen, source.digest) if source else None
        self._watching = watch and source is not None
        self._tasks: set[asyncio.Task[None]] = set()
        self._watcher: asyncio.Task[None] | None = None
        self._signal_installed = False

    def start(self) -> None:
        if self._watching:
            self._watcher = asyncio.create_task(self._watch_file())
        if self._path is not None and threading.current_thread() is threading.main_thread():
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._on_sighup)
            self._signal_installed = True
            release_sighup()  # `tokenweir serve` held it until now

    async def aclose(self) -> None:
        if self._signal_installed:
            hold_sighup()  # shutting down: a late SIGHUP must not end the process either
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        await cancelled([*self._tasks, self._watcher])

    async def reload(self, cause: str) -> Reloaded:
        """Load the file and swap to it; ReloadRefused (logged) leaves all as it was. Each
        outcome but `unchanged` is counted (`counted`): applied, refused or failed."""
        result = "failed"
        try:
            reloaded = await self._reload(cause)
            result = "applied" if reloaded.changed else ""
            return reloaded
        except ReloadRefused as exc:
            result = "refused"
            _log.error("policy reload (%s) refused: %s", cause, exc.message)
            raise
        finally:
            if result and self._counted is not None:
                self._counted(result)

    async def reload_logged(self, cause: str) -> None:
        """`reload` for SIGHUP and the watcher, which have no one to answer: every failure is
        logged here, none escapes (the watcher goes on, a signal's task ends quietly)."""
        try:
            await self.reload(cause)
        except ReloadRefused:
            pass  # logged by `reload`
        except Exception:  # this task's outermost handler: the old policy keeps serving
            _log.exception("policy reload (%s) failed; the old policy keeps serving", cause)

    async def _reload(self, cause: str) -> Reloaded:
        if self._path is None:
            raise ReloadRefused("This gateway was not started from a policy file: nothing to load.")
        async with self._lock:
            current = self._live.current
            source = await _read_still(self._path)
            if self._watch is not None:
                self._watch.loaded(source.digest)
            if source.digest == current.policy_hash:
                return Reloaded(current.policy_hash, current.policy_hash, changed=False)
            sections = restart_needed(current.policy, source.policy)
            if sections:
                raise ReloadRefused(
                    f"{self._path}: {', '.join(sections)} changed, which takes a restart; the "
                    "reload was refused and the old policy keeps serving."
                )
            try:
                new = await current.reloaded(source.policy, source.digest)
            except Exception as exc:  # what the file asks for cannot be built: refuse it
                raise ReloadRefused(
                    f"{self._path}: the policy cannot be applied: {exc}; the reload was refused "
                    "and the old policy keeps serving."
                ) from exc
            await self._live.swap(new)
            if self._accepted is not None:
                self._accepted.keep(source.data)
        _log.info(
            "policy reloaded (%s): %s -> %s, %d tenants",
            cause, current.policy_hash, source.digest, len(source.policy.tenants),
        )  # fmt: skip
        return Reloaded(current.policy_hash, source.digest, changed=True)

    def tell_siblings(self) -> None:
        """Under `tokenweir serve --workers N`: have the supervisor reload every worker."""
        supervisor = os.environ.get(SUPERVISOR_ENV)
        if supervisor and supervisor.isdigit() and int(supervisor) == os.getppid():
            os.kill(int(supervisor), signal.SIGHUP)

    def _on_sighup(self) -> None:
        task = asyncio.create_task(self.reload_logged("SIGHUP"))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch_file(self) -> None:
        """Poll the file (proxy/filewatch.py); reload when it has a new version. A broken file
        is reported once, then again only when it changes."""
        watch = self._watch
        if watch is None:  # nothing to watch (`watch` is set only with a file)
            return
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if watch.changed():
                await self.reload_logged("file changed")
