"""The `anyio_backend` fixture of transport tests that run on both loops: the gateway serves on
uvloop, tests elsewhere run on plain asyncio. A module takes it by importing it."""

from __future__ import annotations

import pytest


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, bool]]:
    return request.param  # type: ignore[no-any-return]
