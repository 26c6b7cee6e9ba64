"""`Attempts` on its own: a request whose call opens without a backend held (no Route stage ran)
is routed as it opens, to a backend of its model, and holds it until settled."""

from __future__ import annotations

import pytest

from proxy.clock import SystemClock
from proxy.routing import Pools
from proxy.routing.attempts import Attempts
from proxy.upstream.client import UpstreamClient
from tests.conftest import make_policy
from tests.contexts import admitted

pytestmark = pytest.mark.anyio


async def test_a_call_opened_without_a_route_is_routed_first(backend_url: str) -> None:
    policy, clock = make_policy(backend_url), SystemClock()
    upstream = UpstreamClient(policy.upstream)
    pools = Pools(policy, clock)
    attempts = Attempts(pools, upstream, clock)
    body = {"model": "mock-llm", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    ctx = admitted(policy.tenants["alpha"], body, tenant_name="alpha")
    try:
        assert ctx.route is None
        backend, response = await attempts.open(ctx, ctx.body)
        try:
            assert response.status_code == 200
        finally:
            await response.aclose()
        assert ctx.route is not None
        assert ctx.backend is backend
        assert backend.name == "mock-a"
        assert ctx.meter in pools.health["mock-a"].active  # held while the request runs
        await attempts.settle(ctx)
        assert ctx.meter not in pools.health["mock-a"].active
    finally:
        await upstream.aclose()
