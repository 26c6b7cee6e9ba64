"""Who may read usage: a Bearer key or a signed session cookie, resolved to a Viewer.

The cookie holds no key: a fingerprint of the key's digest, an expiry, and an HMAC over both
with a secret (per process, or TOKENWEIR_SESSION_SECRET shared by workers and replicas). A key
removed from the policy stops matching its fingerprint, so its sessions end at the next restart.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from proxy.errors import PermissionDenied
from proxy.policy.model import Policy
from proxy.stages.auth import Keyring

__all__ = ["COOKIE_NAME", "Sessions", "Viewer"]

COOKIE_NAME = "tokenweir_session"
_FINGERPRINT_BYTES = 16
_EXPIRY = struct.Struct(">Q")


@dataclass(frozen=True, slots=True)
class Viewer:
    """An admin (`tenant` None: every tenant) or one tenant's key holder."""

    tenant: str | None

    @property
    def is_admin(self) -> bool:
        return self.tenant is None

    def may_read(self, tenant: str | None) -> bool:
        """Admins read any tenant (and all at once, `None`); a tenant reads only itself."""
        return self.is_admin or tenant == self.tenant

    def check(self, tenant: str | None) -> None:
        if not self.may_read(tenant):
            raise PermissionDenied(
                "This key can read only its own tenant's usage.", param="tenant", code="forbidden"
            )


class Sessions:
    """Signs and checks dashboard cookies; authenticates Bearer keys through the Keyring."""

    def __init__(self, policy: Policy, keyring: Keyring, secret: bytes, ttl_s: float) -> None:
        self._keyring = keyring
        self._secret = secret
        self.ttl_s = ttl_s
        self._viewers: dict[bytes, Viewer] = {}
        for name, tenant in policy.tenants.items():
            for key in tenant.api_keys:
                self._viewers[self._fingerprint(_stored_digest(key))] = Viewer(name)
        for key in policy.admin_keys:  # an admin key that is also a tenant's key stays admin
            self._viewers[self._fingerprint(_stored_digest(key))] = Viewer(None)

    def authenticate(self, authorization: str | None) -> Viewer:
        """The viewer a `Bearer <key>` header names, or AuthenticationFailed (401)."""
        if self._keyring.is_admin(authorization):
            return Viewer(None)
        return Viewer(self._keyring.tenant_for(authorization))

    def issue(self, key: str, now: float) -> str:
        """A cookie value for `key` (already authenticated), valid for `ttl_s`."""
        body = self._fingerprint(hashlib.sha256(key.encode()).digest())
        body += _EXPIRY.pack(int(now + self.ttl_s))
        return _b64(body) + "." + _b64(self._mac(body))

    def viewer(self, cookie: str | None, now: float) -> Viewer | None:
        """The viewer a cookie was issued to, or None if it is missing, forged or expired."""
        if not cookie or cookie.count(".") != 1:
            return None
        body_text, mac_text = cookie.split(".")
        try:
            body, mac = _unb64(body_text), _unb64(mac_text)
        except ValueError:
            return None
        if len(body) != _FINGERPRINT_BYTES + _EXPIRY.size:
            return None
        if not hmac.compare_digest(mac, self._mac(body)):
            return None
        (expires,) = _EXPIRY.unpack(body[_FINGERPRINT_BYTES:])
        if expires <= now:
            return None
        return self._viewers.get(body[:_FINGERPRINT_BYTES])

    def resolve(self, headers: Mapping[str, str], cookies: Mapping[str, str], now: float) -> Viewer:
        """A Bearer header wins; else the session cookie; else AuthenticationFailed."""
        authorization = headers.get("authorization")
        if authorization:
            return self.authenticate(authorization)
        found = self.viewer(cookies.get(COOKIE_NAME), now)
        if found is None:
            return self.authenticate(None)  # raises the usual "no key" 401
        return found

    def _fingerprint(self, digest: bytes) -> bytes:
        return hmac.new(self._secret, b"fingerprint:" + digest, "sha256").digest()[
            :_FINGERPRINT_BYTES
        ]

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._secret, b"session:" + body, "sha256").digest()


def _stored_digest(key: str) -> bytes:
    return bytes.fromhex(key.removeprefix("sha256:"))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    """Decode, accepting only the one canonical spelling of the bytes."""
    try:
        data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (ValueError, TypeError) as exc:
        raise ValueError("not base64") from exc
    if _b64(data) != text:
        raise ValueError("not canonical base64")
    return data
