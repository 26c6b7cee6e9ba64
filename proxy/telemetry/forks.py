"""Background threads do not survive a fork: an object that owns one restarts it in the child."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable

__all__ = ["call_in_forked_child"]


def call_in_forked_child(method: Callable[[], None]) -> None:
    """Call the bound `method` in every child forked from now on, while its object lives (the
    registration holds it weakly: an object dropped is not kept alive for a fork to come)."""
    held = weakref.WeakMethod(method)

    def after_fork() -> None:
        alive = held()
        if alive is not None:
            alive()

    os.register_at_fork(after_in_child=after_fork)
