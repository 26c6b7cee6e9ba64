"""A small file replaced in one step: a reader sees its old bytes or its new ones, never part."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["replace_file"]


def replace_file(path: Path, data: bytes) -> None:
    """Write `data` beside `path`, then rename it over `path` (OSError as the system raises it).
    The file written is this process's own: workers replacing one path at once never rename
    each other's half-written file."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_bytes(data)
    os.replace(partial, path)
