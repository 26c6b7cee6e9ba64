"""Under `tokenweir serve --workers N`: the policy the workers serve, kept as the bytes they last
accepted in the server's private directory, so a worker the supervisor starts again serves it
too, not the file as it is now (a version every worker refused, or one not reloaded yet)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from proxy.atomicfile import replace_file

__all__ = ["ACCEPTED_ENV", "AcceptedPolicy"]

ACCEPTED_ENV = "TOKENWEIR_ACCEPTED_POLICY"
_log = logging.getLogger("tokenweir.reload")


class AcceptedPolicy:
    """The file holding the bytes of the policy the server's workers serve."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def from_environment(cls) -> AcceptedPolicy | None:
        """The one set up by the supervisor, or None in a single process."""
        path = os.environ.get(ACCEPTED_ENV)
        return cls(Path(path)) if path else None

    def read(self) -> bytes | None:
        """The bytes last accepted, or None if none were kept (nothing to start from)."""
        try:
            return self.path.read_bytes()
        except OSError:
            return None

    def keep(self, data: bytes) -> None:
        """Replace the bytes kept (atomically: a worker starting meanwhile reads one version)."""
        try:
            replace_file(self.path, data)
        except OSError as exc:  # the directory went away: the server is stopping
            _log.warning("cannot keep the accepted policy in %s: %s", self.path, exc)
