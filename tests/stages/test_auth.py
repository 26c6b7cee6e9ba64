"""Keys: hashed in the policy, matched to their tenant, admin keys apart."""

from __future__ import annotations

import pytest
from starlette.datastructures import Headers

from proxy.errors import AuthenticationFailed
from proxy.stages.auth import Keyring, authorization_of
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


@pytest.mark.parametrize(
    ("values", "presented"),
    [
        ([], None),
        ([b"Bearer a"], "Bearer a"),
        ([b"Bearer a", b"Bearer a"], "Bearer a"),
        ([b"Bearer a", b"bearer  a"], "Bearer a"),  # the same key, spelled otherwise
        ([b"", b"Bearer a"], "Bearer a"),  # an empty header is none
    ],
)
def test_one_key_is_presented(values: list[bytes], presented: str | None) -> None:
    headers = Headers(raw=[(b"host", b"x"), *((b"authorization", v) for v in values)])
    assert authorization_of(headers) == presented


@pytest.mark.parametrize(
    "values", [[b"Bearer a", b"Bearer b"], [b"Bearer a", b"Basic a"], [b"Bearer a", b"Bearer "]]
)
def test_different_keys_are_ambiguous(values: list[bytes]) -> None:
    headers = Headers(raw=[(b"authorization", v) for v in values])
    with pytest.raises(AuthenticationFailed) as refused:
        authorization_of(headers)
    assert refused.value.code == "ambiguous_api_key"
