"""The demo's simulated day: a day's spread, every demo tenant, refusals and failures among them."""

from __future__ import annotations

from collections import Counter

from proxy.app import DEFAULT_POLICY
from proxy.policy import load_policy
from proxy.tools.demotraffic import TENANT_PROFILES, simulated_day

END = 1_800_000_000.0


def test_a_day_of_every_demo_tenant_with_refusals_and_failures() -> None:
    policy = load_policy(DEFAULT_POLICY.with_name("demo.yaml"), environ={})
    day = simulated_day(policy, END)
    assert all(END - 86400 <= record.ts < END for record in day)
    assert [record.ts for record in day] == sorted(record.ts for record in day)
    tenants = Counter(record.tenant for record in day)
    assert {name: tenants[name] for name in TENANT_PROFILES} == {
        name: profile.requests for name, profile in TENANT_PROFILES.items()
    }
    assert tenants[None] > 0  # requests without a valid key
    statuses = Counter(record.status for record in day)
    assert statuses[429] > 0
    assert statuses[502] + statuses[504] > 0
    hours = Counter(int(record.ts // 3600) for record in day)
    assert len(hours) == 24
    assert max(hours.values()) > 3 * min(hours.values())  # busy days and quiet nights
    assert all(record.cost_nusd > 0 for record in day if record.output_tokens)
    assert simulated_day(policy, END) == day  # the same story every time
