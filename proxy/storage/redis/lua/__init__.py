"""The Lua scripts beside this module, read in one place: the operations the link's one script
dispatches (run.lua), and the scripts the key store and the vector writers register."""

from __future__ import annotations

from importlib import resources

__all__ = ["script_text"]


def script_text(name: str) -> str:
    """The text of `name`.lua in this folder."""
    return (resources.files(__package__) / f"{name}.lua").read_text(encoding="utf-8")
