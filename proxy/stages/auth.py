"""Who is calling: the bearer key, hashed, compared in constant time. Writes tenant, tenant_name."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from proxy.context import RequestContext
from proxy.errors import AuthenticationFailed
from proxy.policy.model import Policy, Tenant

__all__ = ["Authenticate", "Keyring"]

_MISSING_KEY = (
    "You didn't provide an API key. You need to provide your API key in an Authorization "
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
_WRONG_KEY = "Incorrect API key provided."


class Keyring:
    """Every key the policy knows, by SHA-256 digest; a presented key is never stored."""

    def __init__(self, policy: Policy) -> None:
        self._tenants: list[tuple[bytes, str]] = [
            (_digest_of_stored(key), name)
            for name, tenant in policy.tenants.items()
            for key in tenant.api_keys
        ]
        self._admins = [_digest_of_stored(key) for key in policy.admin_keys]

    def tenant_for(self, authorization: str | None) -> str:
        """The tenant that owns the bearer key, or AuthenticationFailed."""
        digest = _presented_digest(authorization)
        found: str | None = None
        # Look at every entry, without an early exit, so timing says nothing about which matched.
        for stored, name in self._tenants:
            if hmac.compare_digest(stored, digest):
                found = name
        if found is None:
            raise AuthenticationFailed(_WRONG_KEY)
        return found

    def is_admin(self, authorization: str | None) -> bool:
        try:
            digest = _presented_digest(authorization)
        except AuthenticationFailed:
            return False
        matched = False
        for stored in self._admins:
            matched |= hmac.compare_digest(stored, digest)
        return matched


class Authenticate:
    def __init__(self, keyring: Keyring, tenants: Mapping[str, Tenant]) -> None:
        self._keyring = keyring
        self._tenants = tenants

    async def __call__(self, ctx: RequestContext) -> None:
        name = self._keyring.tenant_for(ctx.headers.get("authorization"))
        ctx.tenant_name = name
        ctx.tenant = self._tenants[name]


def _presented_digest(authorization: str | None) -> bytes:
    if not authorization:
        raise AuthenticationFailed(_MISSING_KEY)
    scheme, _, key = authorization.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise AuthenticationFailed(_MISSING_KEY)
    return hashlib.sha256(key.encode()).digest()


def _digest_of_stored(key: str) -> bytes:
    return bytes.fromhex(key.removeprefix("sha256:"))
