"""Who is calling: the bearer key, hashed, compared in constant time. Makes the arrival an
`Admitted` context (tenant, tenant_name and key_id).

Keys come from the policy file and, created at runtime, from the gateway's storage."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Mapping

from starlette.datastructures import Headers

from proxy.asgi.headers import RequestHeaders
from proxy.context import Admitted, RequestContext
from proxy.errors import AuthenticationFailed
from proxy.keys.record import KeyRecord, policy_key_id
from proxy.keys.runtime import RuntimeKeys
from proxy.policy.model import Policy, Tenant

__all__ = [
    "Authenticate",
    "CurrentKeyring",
    "KeyNoted",
    "Keyring",
    "as_header_value",
    "authorization_of",
]

_MISSING_KEY = (
    "You didn't provide an API key. You need to provide your API key in an Authorization "
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
_WRONG_KEY = "Incorrect API key provided."
_AMBIGUOUS = (
    "This request presents more than one API key (two Authorization headers, or Authorization "
    "and x-api-key, naming different keys): it is not clear whose request it is. Send one key."
)


class Keyring:
    """Every key the policy knows, by SHA-256 digest; a presented key is never stored."""

    def __init__(self, policy: Policy, runtime: RuntimeKeys | None = None) -> None:
        self._runtime = runtime
        self._known = frozenset(policy.tenants)
        self._tenants: list[tuple[bytes, str]] = [
            (_digest_of_stored(key), name)
            for name, tenant in policy.tenants.items()
            for key in tenant.api_keys
        ]
        self._admins = [_digest_of_stored(key) for key in policy.admin_keys]

    def tenant_for(self, authorization: str | None) -> str:
        """The tenant that owns the bearer key, or AuthenticationFailed."""
        return self.identify(authorization)[0]

    def identify(self, authorization: str | None) -> tuple[str, KeyRecord | None]:
        """The key's tenant, and its runtime record if it is not a policy file's key."""
        tenant, _, record = self.identify_key(authorization)
        return tenant, record

    def identify_key(self, authorization: str | None) -> tuple[str, str, KeyRecord | None]:
        """The key's tenant, its non-secret id, and its runtime record if it has one."""
        digest = _presented_digest(authorization)
        found: str | None = None
        # Look at every entry, without an early exit, so timing says nothing about which matched.
        for stored, name in self._tenants:
            if hmac.compare_digest(stored, digest):
                found = name
        if found is not None:
            return found, policy_key_id(digest), None
        record = self._runtime.lookup(digest) if self._runtime is not None else None
        # A runtime key of a tenant the policy no longer has stops working (a reload that
        # removes the tenant revokes it too: proxy/keys/offboard.py).
        if record is None or record.tenant not in self._known:
            raise AuthenticationFailed(_WRONG_KEY)
        return record.tenant, record.id, record

    def is_admin(self, authorization: str | None) -> bool:
        try:
            digest = _presented_digest(authorization)
        except AuthenticationFailed:
            return False
        matched = False
        for stored in self._admins:
            matched |= hmac.compare_digest(stored, digest)
        return matched


class CurrentKeyring(Keyring):
    """The keyring of whichever policy serves now, for routes built once at startup."""

    def __init__(self, current: Callable[[], Keyring]) -> None:  # holds no keys of its own
        self._current = current

    def identify_key(self, authorization: str | None) -> tuple[str, str, KeyRecord | None]:
        return self._current().identify_key(authorization)

    def is_admin(self, authorization: str | None) -> bool:
        return self._current().is_admin(authorization)


KeyNoted = Callable[[Admitted, KeyRecord], None]
"""Told of each request made with a runtime key (which may carry its own budget and limits)."""


class Authenticate:
    def __init__(
        self, keyring: Keyring, tenants: Mapping[str, Tenant], on_key: KeyNoted | None = None
    ) -> None:
        self._keyring = keyring
        self._tenants = tenants
        self._on_key = on_key

    async def __call__(self, ctx: RequestContext) -> Admitted:
        name, key_id, record = self._keyring.identify_key(authorization_of(ctx.headers))
        admitted = ctx.admit(name, self._tenants[name], key_id)
        if record is not None and self._on_key is not None:
            self._on_key(admitted, record)
        return admitted


def authorization_of(headers: Mapping[str, str]) -> str | None:
    """The request's Authorization value, None without one. Several that name different keys
    are refused (401), not read first-wins: a proxy that adds its own header in front of a
    client's would have the request run as whichever key came first."""
    if isinstance(headers, RequestHeaders):  # the request path's: not copied
        pairs = headers.pairs
    elif isinstance(headers, Headers):
        pairs = headers.raw
    else:  # a plain mapping holds one value per name
        return headers.get("authorization")
    found: bytes | None = None
    for name, value in pairs:
        if name == b"authorization" and value:  # an empty one (a proxy's unset variable) is none
            if found is None:
                found = value
            elif value != found and _bearer_key(value) != _bearer_key(found):
                raise AuthenticationFailed(_AMBIGUOUS, code="ambiguous_api_key")
    return None if found is None else found.decode("latin-1")


def _bearer_key(authorization: bytes) -> bytes | None:
    scheme, _, key = authorization.partition(b" ")
    return (key.strip() or None) if scheme.lower() == b"bearer" else None


def _presented_digest(authorization: str | None) -> bytes:
    """The SHA-256 of the key in a header's value, which comes decoded byte for byte (latin-1):
    the key's bytes as sent, so a key of UTF-8 text (as the policy hashes it) matches."""
    if not authorization:
        raise AuthenticationFailed(_MISSING_KEY)
    scheme, _, key = authorization.partition(" ")
    key = key.strip(" \t")  # only what HTTP trims: 0x85 and 0xA0 may be bytes of a UTF-8 key
    if scheme.lower() != "bearer" or not key:
        raise AuthenticationFailed(_MISSING_KEY)
    try:
        sent = key.encode("latin-1")
    except UnicodeEncodeError:  # no header holds it (see `as_header_value`)
        raise AuthenticationFailed(_WRONG_KEY) from None
    return hashlib.sha256(sent).digest()


def as_header_value(text: str) -> str:
    """`text` (a key typed in a form) as a header carrying its UTF-8 bytes reads."""
    return text.encode().decode("latin-1")


def _digest_of_stored(key: str) -> bytes:
    return bytes.fromhex(key.removeprefix("sha256:"))
