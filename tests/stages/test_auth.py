"""Keys: hashed in the policy, matched to their tenant, admin keys apart."""

from __future__ import annotations

import pytest

from proxy.errors import AuthenticationFailed
from proxy.stages.auth import Keyring
from tests.conftest import ADMIN_KEY, ALPHA_KEY, BETA_KEY, make_policy


@pytest.fixture
def keyring() -> Keyring:
    return Keyring(make_policy("http://127.0.0.1:9"))


def test_keys_map_to_their_tenants(keyring: Keyring) -> None:
    assert keyring.tenant_for(f"Bearer {ALPHA_KEY}") == "alpha"
    assert keyring.tenant_for(f"bearer {BETA_KEY}") == "beta"  # ${ENV} keys are hashed at load


@pytest.mark.parametrize(
    "header",
    [None, "", "Bearer", "Bearer ", f"Basic {ALPHA_KEY}", f"Bearer {ALPHA_KEY}x", ADMIN_KEY],
)
def test_anything_else_is_refused(keyring: Keyring, header: str | None) -> None:
    with pytest.raises(AuthenticationFailed):
        keyring.tenant_for(header)


def test_admin_keys_are_not_tenant_keys(keyring: Keyring) -> None:
    assert keyring.is_admin(f"Bearer {ADMIN_KEY}")
    assert not keyring.is_admin(f"Bearer {ALPHA_KEY}")
    assert not keyring.is_admin(None)
    with pytest.raises(AuthenticationFailed):
        keyring.tenant_for(f"Bearer {ADMIN_KEY}")
