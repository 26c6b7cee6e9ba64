"""A serving process keeps what startup built out of the collector's full passes."""

from __future__ import annotations

import gc

import pytest

from proxy.app import create_app
from tests.conftest import make_policy

pytestmark = pytest.mark.anyio


async def test_a_serving_app_freezes_its_startup_heap_and_a_test_app_does_not(
    backend_url: str,
) -> None:
    gc.unfreeze()
    plain = create_app(make_policy(backend_url))
    async with plain.router.lifespan_context(plain):
        assert gc.get_freeze_count() == 0
    served = create_app(make_policy(backend_url), freeze_gc=True)
    try:
        async with served.router.lifespan_context(served):
            # The policy, tokenizers, stores and every module loaded: tens of thousands.
            assert gc.get_freeze_count() > 10_000
    finally:
        gc.unfreeze()
