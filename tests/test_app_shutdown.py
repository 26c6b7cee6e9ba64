"""Shutdown is bounded: a collaborator whose close hangs is logged and left behind, so the
process still exits (a replica that never exits holds up `docker stop` and rolling updates)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from proxy.app import create_app
from proxy.storage import MemoryStore
from tests.conftest import make_policy

pytestmark = pytest.mark.anyio


class HangingStore(MemoryStore):
    async def aclose(self) -> None:
        await asyncio.Event().wait()


async def test_a_close_that_hangs_does_not_hold_up_shutdown(
    backend_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(make_policy(backend_url), store=HangingStore())
    with caplog.at_level(logging.ERROR, logger="tokenweir"):
        async with asyncio.timeout(60):  # a limit, not a measurement: unbounded, this hangs
            async with app.router.lifespan_context(app):
                pass
    assert "closing the quota store took over" in caplog.text
