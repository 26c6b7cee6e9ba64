"""A policy file watched by polling its stamp: a change counts once the file has held still for
one poll and its bytes differ from the version last seen (a file still being written is never
taken half-way: a part without a tenant would revoke that tenant's runtime keys). Its bytes are
read as a reload reads them, never past the size a policy file may hold."""

from __future__ import annotations

import hashlib
from pathlib import Path

from proxy.policy import PolicyError, read_policy_bytes

__all__ = ["FileStamp", "FileWatch", "file_digest", "read_version", "stamp"]

# What the watcher compares: (mtime, size, inode, ctime) of the file a symlink leads to. The
# inode changes when a new file takes the name (a Kubernetes ConfigMap swaps its `..data` link),
# the ctime with every write or rename, even when a copy kept the old mtime and the size.
FileStamp = tuple[int, int, int, int]


def file_digest(data: bytes) -> str:
    """A policy file's version: the digest of its bytes."""
    return hashlib.sha256(data).hexdigest()[:16]


def read_version(path: Path) -> str | None:
    """The version of the policy file at `path`, its bytes read through `read_policy_bytes` as
    a reload reads them; None if it cannot be read or holds more than a policy may (a reload
    refuses it and says why). A whole read took an 8 GiB file, or /dev/zero, into memory."""
    try:
        return file_digest(read_policy_bytes(path))
    except PolicyError:
        return None


def stamp(path: Path) -> FileStamp | None:
    """The file's stamp; None if it cannot be read."""
    try:
        info = path.stat()
    except OSError:
        return None
    return info.st_mtime_ns, info.st_size, info.st_ino, info.st_ctime_ns


class FileWatch:
    """`changed()`, called once per poll, says when the file has a new version to load."""

    def __init__(self, path: Path, seen: FileStamp | None, digest: str) -> None:
        """`seen` and `digest`: the file as it was when last read (a save since then, while
        the gateway started, is a change to see)."""
        self.path = path
        self._seen = seen
        self._digest = digest
        self._changing: FileStamp | None = None  # a change seen at the last poll

    def loaded(self, digest: str) -> None:
        """A version read meanwhile (a reload): the same bytes are no change to see again."""
        self._digest = digest

    def changed(self) -> bool:
        """True once the file changed, held still since the last poll, and holds bytes other
        than the version last seen."""
        seen = stamp(self.path)
        if seen is None or seen == self._seen:
            self._changing = None
            return False
        if seen != self._changing:  # changed since the last poll: wait for it to hold still
            self._changing = seen
            return False
        self._seen, self._changing = seen, None
        return read_version(self.path) != self._digest
