"""Waiting for several calls: together (overlapping) or in turn (already under way)."""

from __future__ import annotations

import pytest

from proxy.together import in_turn, nothing

pytestmark = pytest.mark.anyio


async def test_in_turn_waits_for_every_call_and_raises_the_first_error() -> None:
    done: list[str] = []

    async def call(name: str, fails: bool = False) -> None:
        done.append(name)
        if fails:
            raise ValueError(name)

    with pytest.raises(ValueError, match="b"):
        await in_turn([call("a"), call("b", fails=True), call("c", fails=True), nothing()])
    assert done == ["a", "b", "c"]
