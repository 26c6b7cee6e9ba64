"""Degradation rules: each fires on its signal and not otherwise; first match wins; shadow mode
records and changes nothing; priorities are shed first under overload."""

from __future__ import annotations

import pytest

from proxy.clock import FakeClock
from proxy.context import Admitted
from proxy.cost import PriceTable
from proxy.errors import GatewayError, RateLimited, UpstreamUnavailable
from proxy.policy import Policy, parse_policy
from proxy.policy.units import hash_key
from proxy.routing import Pools
from proxy.stages.budget import Budgets
from proxy.stages.degrade import SHED_RULE, Degrade
from proxy.stages.storagepolicy import StorageFailures
from proxy.storage import MemoryStore, StorageError
from proxy.telemetry.sample import sample_of
from tests.contexts import admitted

pytestmark = pytest.mark.anyio

# One backend with room for 10 requests, so in-flight ratios are tenths.
BASE = f"""
backends:
  - {{name: a, url: "http://127.0.0.1:1/v1", models: [m, small], limits: {{max_concurrent: 10}}}}
models: {{m: {{}}, small: {{}}}}
tenants:
  t:
    api_keys: [{hash_key("k")}]
    models: [m]
    budget: {{tokens_per_day: 100000}}
"""

SIGNALS = {
    "inflight_ratio_above": ("0.5", "inflight", 6, 5),
    "queue_depth_above": ("3", "inflight", 4, 3),
    "backend_ttft_p95_above": ("2s", "ttft", 3.0, 1.0),
    "backend_error_rate_above": ("0.5", "errors", 6, 4),
    "budget_used_above": ("0.9", "budget", 95000, 80000),
    "storage_unavailable": ("true", "storage", True, False),
}


class Setup:
    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.clock = FakeClock()
        self.pools = Pools(policy, self.clock)
        self.store = MemoryStore()
        self.failures = StorageFailures(self.clock)
        self.budgets = Budgets(self.store, PriceTable(policy), self.clock, self.failures)
        self.stage = Degrade(self.pools, self.clock, self.store, self.failures)

    def ctx(self, tenant: str = "t") -> Admitted:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 500}
        return admitted(
            self.policy.tenants[tenant], body, tenant_name=tenant, counted=10, allowance=500,
            received_wall=self.clock.wall(),
        )  # fmt: skip

    async def signal(self, kind: str, amount: float | bool) -> None:
        health = self.pools.health["a"]
        now = self.clock.monotonic()
        if kind == "inflight":
            for _ in range(int(amount)):
                health.active.add(self.ctx().meter)
        elif kind == "ttft":
            for _ in range(10):
                health.ttft.add(now, float(amount))
        elif kind == "errors":
            for i in range(8):
                (health.failed(now) if i < amount else health.served(now, None, None))
        elif kind == "budget":
            used = self.ctx()
            used.counted_input_tokens, used.outgoing.allowance = int(amount), 0
            await self.budgets(used)
            used.input_tokens, used.output_tokens = int(amount), 0
            await self.budgets.settle(used)
        elif amount:
            self.failures.decide("quota", self.policy.tenants["t"].limits, StorageError("down"))

    async def run(self, ctx: Admitted) -> Admitted:
        await self.budgets(ctx)
        await self.stage(ctx)
        return ctx


def _policy(rules: str, tenant_extra: str = "") -> Policy:
    return parse_policy(BASE + f"    degrade:\n{rules}{tenant_extra}", environ={})


@pytest.mark.parametrize("condition", sorted(SIGNALS))
async def test_each_rule_fires_on_its_signal_and_not_otherwise(condition: str) -> None:
    threshold, kind, above, below = SIGNALS[condition]
    when = f"{{{condition}: {threshold}}}"
    rules = f"      - {{name: r, when: {when}, then: {{max_output_tokens: 64}}}}\n"
    quiet = Setup(_policy(rules))
    await quiet.signal(kind, below)
    calm = await quiet.run(quiet.ctx())
    assert calm.degraded == []
    assert calm.body["max_tokens"] == 500
    loud = Setup(_policy(rules))
    await loud.signal(kind, above)
    fired = await loud.run(loud.ctx())
    assert fired.degraded == ["r"]
    assert fired.body["max_tokens"] == 64


async def test_first_match_wins_and_actions_apply() -> None:
    rules = (
        "      - {name: never, when: {queue_depth_above: 100}, then: {reject: 503}}\n"
        "      - {name: spill, when: {inflight_ratio_above: 0.1}, then: {model: small}}\n"
        "      - {name: also, when: {inflight_ratio_above: 0.1}, then: {max_output_tokens: 8}}\n"
    )
    setup = Setup(_policy(rules))
    await setup.signal("inflight", 3)
    ctx = await setup.run(setup.ctx())
    assert ctx.degraded == ["spill"]
    assert (ctx.model, ctx.body["model"], ctx.body["max_tokens"]) == ("small", "small", 500)


@pytest.mark.parametrize(("status", "error"), [(503, UpstreamUnavailable), (429, RateLimited)])
async def test_reject_answers_with_retry_after(status: int, error: type[GatewayError]) -> None:
    rules = f"      - {{name: full, when: {{}}, then: {{reject: {status}, retry_after: 3s}}}}\n"
    setup = Setup(_policy(rules))
    ctx = setup.ctx()
    with pytest.raises(error) as raised:
        await setup.run(ctx)
    assert raised.value.status == status
    assert raised.value.headers() == {"retry-after": "3", "retry-after-ms": "3000"}
    assert ctx.degraded == ["full"]


async def test_cache_actions_set_the_looser_bar_for_the_cache() -> None:
    rules = "      - {name: loose, when: {}, then: {cache: serve_stale, similarity: 0.85}}\n"
    setup = Setup(_policy(rules))
    ctx = await setup.run(setup.ctx())
    assert (ctx.cache_serve_stale, ctx.cache_min_similarity) == (True, 0.85)


async def test_low_priority_is_shed_first_under_overload() -> None:
    rules = "      - {name: demote, when: {inflight_ratio_above: 0.5}, then: {priority: low}}\n"
    setup = Setup(_policy(rules))
    await setup.signal("inflight", 8)  # 80% full: low is shed, normal is not
    with pytest.raises(UpstreamUnavailable) as raised:
        await setup.run(setup.ctx())
    assert raised.value.code == "overloaded"
    plain = Setup(_policy("      - {name: quiet, when: {queue_depth_above: 100}, then: {}}\n"))
    await plain.signal("inflight", 8)
    assert (await plain.run(plain.ctx())).degraded == []


async def test_tenant_priority_decides_who_is_shed() -> None:
    text = BASE.replace(
        "tenants:\n",
        f"tenants:\n  vip: {{api_keys: [{hash_key('v')}], "
        "models: [m], priority: high}\n  batch: {api_keys: "
        f"[{hash_key('b')}], models: [m], priority: low}}\n",
    )
    setup = Setup(parse_policy(text, environ={}))
    await setup.signal("inflight", 9)  # 90% full: low is shed, normal and high are not
    await setup.stage(setup.ctx("vip"))
    await setup.stage(setup.ctx("t"))
    with pytest.raises(UpstreamUnavailable):
        await setup.stage(setup.ctx("batch"))
    await setup.signal("inflight", 10)  # full: normal is shed too; high meets the backend's limit
    await setup.stage(setup.ctx("vip"))
    with pytest.raises(UpstreamUnavailable) as raised:
        await setup.stage(setup.ctx("t"))
    assert raised.value.code == "overloaded"


async def test_the_backends_count_across_replicas_is_believed_while_fresh() -> None:
    """Another replica's requests count toward the load (tests/web/test_shedding_replicas.py
    end to end): 8 of 10 in flight by the backend's slot pool at this process's last admission
    sheds low priority; a request of this process ending since lowers it; a second later the
    count is stale and only this process's own requests are known."""
    text = BASE.replace(
        "tenants:\n",
        f"tenants:\n  batch: {{api_keys: [{hash_key('b')}], models: [m], priority: low}}\n",
    )
    setup = Setup(parse_policy(text, environ={}))
    health = setup.pools.health["a"]
    mine = setup.ctx().meter
    health.active.add(mine)
    health.counted(8, setup.clock.monotonic())
    with pytest.raises(UpstreamUnavailable):
        await setup.stage(setup.ctx("batch"))
    health.left(mine, counted=True)  # 7 of 10
    await setup.stage(setup.ctx("batch"))
    health.counted(9, setup.clock.monotonic())
    setup.clock.advance(1.5)  # stale: this process holds nothing
    await setup.stage(setup.ctx("batch"))


@pytest.mark.parametrize("where", ["rule", "tenant"])
async def test_shadow_mode_records_and_changes_nothing(where: str) -> None:
    shadow_rule = ", shadow: true" if where == "rule" else ""
    rules = (
        f"      - {{name: strict, when: {{}}, then: {{reject: 503, priority: low}}{shadow_rule}}}\n"
    )
    tenant_extra = "\n    shadow: true\n    priority: low" if where == "tenant" else ""
    setup = Setup(_policy(rules, tenant_extra))
    # 90% full: a low-priority tenant in shadow would have been shed; that is recorded only.
    await setup.signal("inflight", 9)
    ctx = await setup.run(setup.ctx())
    assert ctx.degraded == []
    assert ctx.degraded_shadow[0] == "strict"
    assert (ctx.model, ctx.body["max_tokens"]) == ("m", 500)
    if where == "tenant":
        assert ctx.degraded_shadow == ["strict", SHED_RULE]


async def test_a_shadow_rule_does_not_hide_the_live_rule_behind_it() -> None:
    rules = (
        "      - {name: trial, when: {}, then: {reject: 503}, shadow: true}\n"
        "      - {name: live, when: {}, then: {max_output_tokens: 32}}\n"
    )
    setup = Setup(_policy(rules))
    ctx = await setup.run(setup.ctx())
    assert (ctx.degraded, ctx.degraded_shadow, ctx.body["max_tokens"]) == (["live"], ["trial"], 32)


def test_the_metrics_name_a_rule_the_tenant_has_and_call_any_other_other() -> None:
    """`tokenweir_degraded_requests{rule=...}` stays bounded by the policy: a rule name the
    tenant does not have (the priority shedding's, a stale one) is `other`; none is ()."""
    rules = "      - {name: spill, when: {inflight_ratio_above: 0.1}, then: {model: small}}\n"
    policy = _policy(rules)
    ctx = Setup(policy).ctx()
    assert sample_of(ctx, policy, 0, 0.001).degraded == ()
    ctx.degraded = ["spill", "gone", SHED_RULE]
    assert sample_of(ctx, policy, 0, 0.001).degraded == ("spill", "other", "other")


async def test_a_backend_that_is_down_adds_no_room_to_the_ratio() -> None:
    """Two backends of 5 slots, one down: 4 in flight on the other is 80% of what the model can
    serve. It read as 4 of 10: the rule at 0.5 did not fire, and low priority was not shed."""
    policy = parse_policy(
        BASE.replace(
            "models: [m, small], limits: {max_concurrent: 10}}",
            "models: [m, small], limits: {max_concurrent: 5}}\n"
            '  - {name: b, url: "http://127.0.0.1:2/v1", models: [m], limits: {max_concurrent: 5}}',
        )
        + "    degrade: [{name: r, when: {inflight_ratio_above: 0.5}, then: {priority: low}}]\n",
        environ={},
    )
    setup = Setup(policy)
    setup.pools.health["b"].probe_error = "connection refused"
    await setup.signal("inflight", 4)
    ctx = setup.ctx()
    with pytest.raises(UpstreamUnavailable, match="overloaded"):
        await setup.run(ctx)
    assert ctx.degraded == ["r"]
