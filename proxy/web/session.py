"""Who may read usage: a Bearer key or a signed session cookie, resolved to a Viewer.

The cookie holds no key: a fingerprint of the key's digest, a random session id, an expiry,
and an HMAC over them with a secret (per process, or TOKENWEIR_SESSION_SECRET shared by workers
and replicas). Logging out records the session id as ended in the storage, so the cookie stops
working on every replica at once; a key removed from the policy (on a reload too) stops matching
its fingerprint.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import secrets
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from starlette.requests import HTTPConnection

from proxy.errors import AuthenticationFailed, PermissionDenied, StorageUnavailable
from proxy.policy.model import Policy
from proxy.stages.auth import Keyring, authorization_of
from proxy.storage.base import StorageError
from proxy.storage.sessions import EndedSessions

__all__ = [
    "COOKIE_NAME",
    "SECURE_COOKIE_NAME",
    "Session",
    "Sessions",
    "Viewer",
    "caller",
    "cookie_name",
]

_log = logging.getLogger("tokenweir.dashboard")

COOKIE_NAME = "tokenweir_session"
# Over https: a name browsers take only from this host, with Secure and Path=/, so a sibling
# subdomain (or an http page of the host) cannot plant a session of its own in its place.
SECURE_COOKIE_NAME = "__Host-" + COOKIE_NAME
_FINGERPRINT_BYTES = 16
_SESSION_ID_BYTES = 16
_SIGNED_BYTES = _FINGERPRINT_BYTES + _SESSION_ID_BYTES
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


@dataclass(frozen=True, slots=True)
class Session:
    """What a valid cookie says: who it was issued to, its id and when it expires."""

    viewer: Viewer
    session_id: bytes
    expires_wall: float


class Sessions:
    """Signs and checks dashboard cookies; authenticates Bearer keys through the Keyring."""

    def __init__(
        self, policy: Callable[[], Policy], keyring: Keyring, secret: bytes, ttl_s: float
    ) -> None:
        """`policy` gives the policy serving now: a cookie is checked against its keys, so
        after a reload a removed key's sessions end and a new key's work."""
        self._policy = policy
        self._keyring = keyring
        self._secret = secret
        self.ttl_s = ttl_s
        self._viewers_of: tuple[Policy, dict[bytes, Viewer]] | None = None

    def _viewers(self) -> dict[bytes, Viewer]:
        """Who each key fingerprint is, for the current policy (worked out once per policy)."""
        policy = self._policy()
        if self._viewers_of is not None and self._viewers_of[0] is policy:
            return self._viewers_of[1]
        viewers: dict[bytes, Viewer] = {}
        for name, tenant in policy.tenants.items():
            for key in tenant.api_keys:
                viewers[self._fingerprint(_stored_digest(key))] = Viewer(name)
        for key in policy.admin_keys:  # an admin key that is also a tenant's key stays admin
            viewers[self._fingerprint(_stored_digest(key))] = Viewer(None)
        self._viewers_of = (policy, viewers)
        return viewers

    def authenticate(self, authorization: str | None, caller: str = "") -> Viewer:
        """The viewer a `Bearer <key>` header names, or AuthenticationFailed (401). A key given
        and refused is logged with `caller` (where and from whom, never the key): guesses made
        here leave a trace, as those on the API routes do in the access log."""
        if self._keyring.is_admin(authorization):
            return Viewer(None)
        try:
            return Viewer(self._keyring.tenant_for(authorization))
        except AuthenticationFailed:
            if authorization and authorization.partition(" ")[2].strip():
                _log.warning("refused a key this gateway does not know: %s", caller)
            raise

    def issue(self, key: str, now: float) -> str | None:
        """A cookie value for `key` (already authenticated), valid for `ttl_s`; None for a key
        the policy file does not hold (a runtime key), which no cookie can name."""
        body = self._fingerprint(hashlib.sha256(key.encode()).digest())
        if body not in self._viewers():
            return None
        body += secrets.token_bytes(_SESSION_ID_BYTES)
        body += _EXPIRY.pack(int(now + self.ttl_s))
        return _b64(body) + "." + _b64(self._mac(body))

    def session(self, cookie: str | None, now: float) -> Session | None:
        """The session a cookie carries, or None if it is missing, forged, expired or its key
        is no longer known. Whether it was ended by a logout is `resolve`'s question."""
        if not cookie or cookie.count(".") != 1:
            return None
        body_text, mac_text = cookie.split(".")
        try:
            body, mac = _unb64(body_text), _unb64(mac_text)
        except ValueError:
            return None
        if len(body) != _SIGNED_BYTES + _EXPIRY.size:
            return None
        if not hmac.compare_digest(mac, self._mac(body)):
            return None
        (expires,) = _EXPIRY.unpack(body[_SIGNED_BYTES:])
        viewer = self._viewers().get(body[:_FINGERPRINT_BYTES])
        if expires <= now or viewer is None:
            return None
        return Session(viewer, body[_FINGERPRINT_BYTES:_SIGNED_BYTES], float(expires))

    async def resolve(
        self,
        headers: Mapping[str, str],
        cookies: Mapping[str, str],
        now: float,
        ended: EndedSessions,
        caller: str = "",
        *,
        cookie: str = COOKIE_NAME,
    ) -> Viewer:
        """A Bearer header wins; else a session cookie not logged out; else
        AuthenticationFailed."""
        authorization = authorization_of(headers)
        if authorization:
            return self.authenticate(authorization, caller)
        found = self.session(cookies.get(cookie), now)
        if found is None or await _has_ended(ended, found, now):
            return self.authenticate(None)  # raises the usual "no key" 401
        return found.viewer

    async def end(self, cookie: str | None, now: float, ended: EndedSessions) -> None:
        """Log out: the cookie's session is refused from now on, by every replica."""
        found = self.session(cookie, now)
        if found is not None:
            try:
                await ended.end(found.session_id, found.expires_wall, now)
            except StorageError as exc:
                raise StorageUnavailable(
                    f"The session could not be ended: {exc}", retry_after_s=5
                ) from exc

    def _fingerprint(self, digest: bytes) -> bytes:
        return hmac.new(self._secret, b"fingerprint:" + digest, "sha256").digest()[
            :_FINGERPRINT_BYTES
        ]

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._secret, b"session:" + body, "sha256").digest()


async def _has_ended(ended: EndedSessions, found: Session, now: float) -> bool:
    try:
        return await ended.ended(found.session_id, now)
    except StorageError as exc:  # closed, not open: a logged-out cookie must not read usage
        raise StorageUnavailable(f"The session cannot be checked: {exc}", retry_after_s=5) from exc


def cookie_name(connection: HTTPConnection) -> str:
    """The session cookie's name on this connection: `SECURE_COOKIE_NAME` over https (as the
    client sees it: a trusted proxy's `X-Forwarded-Proto` counts), else `COOKIE_NAME`."""
    return SECURE_COOKIE_NAME if connection.url.scheme == "https" else COOKIE_NAME


def caller(connection: HTTPConnection, where: str) -> str:
    """`where` and the client's address (behind a trusted proxy, from X-Forwarded-For), for
    the log."""
    client = connection.client.host if connection.client else "an unknown address"
    return f"{where} from {client}"


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
