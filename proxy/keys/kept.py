"""Under `tokenweir serve --workers N`: the runtime keys' stored records (hashes only, as in
storage) as the workers last read them, kept in the server's private directory beside the
accepted policy, so that a worker started again while the storage is down knows the keys its
siblings know. A key revoked through this server never comes back from it."""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from proxy.atomicfile import replace_file

__all__ = ["KEPT_KEYS_ENV", "KeptKeys"]

KEPT_KEYS_ENV = "TOKENWEIR_KEPT_KEYS"
_log = logging.getLogger("tokenweir.keys")


class KeptKeys:
    """The file of the records last read from the key storage by any worker of the server."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._failed = False

    @classmethod
    def from_environment(cls) -> KeptKeys | None:
        """The one set up by the supervisor, or None in a single process."""
        path = os.environ.get(KEPT_KEYS_ENV)
        return cls(Path(path)) if path else None

    def read(self) -> dict[str, bytes]:
        """The records kept, by id, less those revoked since (none if nothing was kept)."""
        kept = self._load()
        revoked = set(kept.get("revoked", ()))
        records: dict[str, str] = kept.get("records", {})
        return {key_id: data.encode() for key_id, data in records.items() if key_id not in revoked}

    def keep(self, version: int, records: dict[str, bytes], *, restarted: bool = False) -> None:
        """The records read at `version`, unless a worker kept a later version already (this
        one's read came in late); `restarted`: the storage's version went back (it lost its
        data), so this read is the newest whatever the number."""

        def newer(kept: dict[str, Any]) -> None:
            if restarted or kept.get("version", -1) <= version:
                kept["version"] = version
                kept["records"] = {key_id: data.decode() for key_id, data in records.items()}

        self._change(newer)

    def add(self, key_id: str, record: bytes) -> None:
        """A key just created: known to a worker started before any worker reads it back."""
        self._change(lambda kept: kept.setdefault("records", {}).update({key_id: record.decode()}))

    def revoke(self, key_id: str) -> None:
        """A key just revoked: gone from the copy, and never taken back from a late read."""

        def without(kept: dict[str, Any]) -> None:
            kept.setdefault("records", {}).pop(key_id, None)
            kept["revoked"] = sorted({*kept.get("revoked", ()), key_id})

        self._change(without)

    def _load(self) -> dict[str, Any]:
        try:
            loaded: dict[str, Any] = orjson.loads(self.path.read_bytes())
        except (OSError, orjson.JSONDecodeError):  # none yet, or the server is stopping
            return {}
        return loaded

    def _change(self, change: Callable[[dict[str, Any]], None]) -> None:
        """Apply `change` to the copy, one worker at a time (a few ms: a local file, no await)."""
        lock = self.path.with_name(self.path.name + ".lock")
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                kept = self._load()
                change(kept)
                replace_file(self.path, orjson.dumps(kept))
            finally:
                os.close(fd)  # and the lock with it
        except OSError as exc:  # the directory went away: the server is stopping
            if not self._failed:
                _log.warning("cannot keep the runtime keys in %s: %s", self.path, exc)
            self._failed = True
