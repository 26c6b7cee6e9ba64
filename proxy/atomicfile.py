"""A small file replaced in one step: a reader sees its old bytes or its new ones, never part."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["replace_file"]


def replace_file(path: Path, data: bytes) -> None:
    """Write `data` beside `path`, then rename it over `path` (OSError as the system raises it)."""
    partial = path.with_suffix(".partial")
    partial.write_bytes(data)
    os.replace(partial, path)
