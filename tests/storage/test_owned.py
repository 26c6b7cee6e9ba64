"""Whose stored object an id is, on memory and Redis: a claim holds for its own tenant until it
expires, for no other tenant, and memory forgets a tenant's oldest claims past its bound."""

from __future__ import annotations

import pytest

from proxy.storage import open_storage
from proxy.storage.owned import MemoryOwnedIds, open_owned_ids

NOW = 1_900_000_000.0


@pytest.mark.anyio
async def test_a_claim_is_its_tenants_alone_until_it_expires(storage_url: str) -> None:
    """On every storage (Redis, Sentinel and Cluster alike, on the stores' own link)."""
    storage = open_storage(storage_url)
    owned = open_owned_ids(storage)
    try:
        await owned.claim("alice", "resp_1", NOW + 60)
        assert await owned.owns("alice", "resp_1", NOW)
        assert not await owned.owns("bob", "resp_1", NOW)
        assert not await owned.owns("alice", "resp_2", NOW)
        # Names that run together differently are other pairs.
        assert not await owned.owns("alice\0resp", "_1", NOW)
        if storage_url == "memory":  # Redis's own clock expires its keys
            assert not await owned.owns("alice", "resp_1", NOW + 61)
    finally:
        await owned.aclose()
        await storage.aclose()


@pytest.mark.anyio
async def test_memory_forgets_a_tenants_oldest_claims_past_its_bound() -> None:
    """Each tenant's own: one tenant's many answers push out none of another's."""
    owned = MemoryOwnedIds(most=3)
    await owned.claim("bob", "resp_bob", NOW + 60)
    for number in range(5):
        await owned.claim("alice", f"resp_{number}", NOW + 60)
    assert len(owned) == 4
    held = [await owned.owns("alice", f"resp_{n}", NOW) for n in range(5)]
    assert held == [False, False, True, True, True]
    assert await owned.owns("bob", "resp_bob", NOW)
